# The program of docs/your-own-training-loop.md, taken from the page at configure time, compiled, and run as threads
# and under mpirun: the page cannot drift from the library.
if(LOOM_WITH_MPI)
  set(_page ${PROJECT_SOURCE_DIR}/docs/your-own-training-loop.md)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_page})
  file(READ ${_page} _text)
  string(FIND "${_text}" "```cpp\n" _begin)
  if(_begin EQUAL -1)
    message(FATAL_ERROR "loom: ${_page} has no ```cpp block")
  endif()
  math(EXPR _begin "${_begin} + 7")
  string(SUBSTRING "${_text}" ${_begin} -1 _text)
  string(FIND "${_text}" "```" _end)
  string(SUBSTRING "${_text}" 0 ${_end} _code)
  file(GENERATE OUTPUT ${CMAKE_CURRENT_BINARY_DIR}/doc_training_loop.cpp CONTENT "${_code}")
  add_executable(doc_training_loop ${CMAKE_CURRENT_BINARY_DIR}/doc_training_loop.cpp)
  target_link_libraries(doc_training_loop PRIVATE loom::mpi)
  # The loss of the tiny model falls from about 5.5 to below 4 in 30 steps, as threads and as processes.
  set(_expect "loss 5\\.[0-9]+ -> [0-3]\\.[0-9]+ in 30 steps on tp2\\.pp2\\.dp2")
  add_test(NAME doc_training_loop.threads
    COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:doc_training_loop>" "-DEXPECT_REGEX=${_expect}"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  add_test(NAME doc_training_loop.mpi
    COMMAND ${CMAKE_COMMAND}
            "-DCMD=${MPIEXEC_EXECUTABLE};--oversubscribe;--bind-to;none;-np;8;$<TARGET_FILE:doc_training_loop>"
            "-DEXPECT_REGEX=${_expect}" -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(doc_training_loop.threads doc_training_loop.mpi PROPERTIES LABELS "docs;model")
  set_tests_properties(doc_training_loop.mpi PROPERTIES LABELS "docs;model;mpi"
                       ENVIRONMENT "OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endif()
