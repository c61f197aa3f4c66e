# The installed package works for a separate project (find_package), and so does add_subdirectory.
add_test(NAME consumer_project
  COMMAND ${CMAKE_COMMAND} -DSRC=${PROJECT_SOURCE_DIR} -DBIN=${PROJECT_BINARY_DIR}
          -DWORK=${LOOM_TEST_SCRATCH}/consumer -P ${PROJECT_SOURCE_DIR}/cmake/consumer_test.cmake)
set_tests_properties(consumer_project PROPERTIES LABELS install TIMEOUT 600)
