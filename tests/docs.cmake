# Programs written on docs pages, taken from the page at configure time (every ```cpp block, in order), compiled and
# run: a page cannot drift from the library.
function(loom_doc_program page out)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${page})
  file(READ ${page} _text)
  set(_code "")
  while(TRUE)
    string(FIND "${_text}" "```cpp\n" _begin)
    if(_begin EQUAL -1)
      break()
    endif()
    math(EXPR _begin "${_begin} + 7")
    string(SUBSTRING "${_text}" ${_begin} -1 _text)
    string(FIND "${_text}" "```" _end)
    string(SUBSTRING "${_text}" 0 ${_end} _block)
    string(APPEND _code "${_block}\n")
    math(EXPR _end "${_end} + 3")
    string(SUBSTRING "${_text}" ${_end} -1 _text)
  endwhile()
  if(_code STREQUAL "")
    message(FATAL_ERROR "loom: ${page} has no ```cpp block")
  endif()
  file(GENERATE OUTPUT ${out} CONTENT "${_code}")
endfunction()

# docs/your-own-model.md: a model of one's own, trained on TP2.DP2 and checked on three layouts by the testing kit.
loom_doc_program(${PROJECT_SOURCE_DIR}/docs/your-own-model.md ${CMAKE_CURRENT_BINARY_DIR}/doc_own_model.cpp)
add_executable(doc_own_model ${CMAKE_CURRENT_BINARY_DIR}/doc_own_model.cpp)
target_link_libraries(doc_own_model PRIVATE loom::loom)
# The loss falls by more than 40% in 30 steps, and each of the three layouts is the single-rank model.
add_test(NAME doc_own_model
  COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:doc_own_model>"
          "-DEXPECT_REGEX=loss [0-9.]+ -> [0-9.]+ in 30 steps on tp2\\.dp2.*tp2\\.dp2: loss .*tolerance 1e-09.*pp2[^ ]*: loss .*tp2\\.pp2[^ ]*: loss "
          -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
set_tests_properties(doc_own_model PROPERTIES LABELS "docs;model")

# docs/your-own-training-loop.md, run as threads and under mpirun.
if(LOOM_WITH_MPI)
  loom_doc_program(${PROJECT_SOURCE_DIR}/docs/your-own-training-loop.md ${CMAKE_CURRENT_BINARY_DIR}/doc_training_loop.cpp)
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
  # The same page header-only, as a project that does not link loom::cpu_kernels builds it: the kernels, the Local
  # backend, the model and the trainer from the headers alone (the directory's link to loom::cpu_kernels replaced).
  add_executable(doc_training_loop_header_only ${CMAKE_CURRENT_BINARY_DIR}/doc_training_loop.cpp)
  set_property(TARGET doc_training_loop_header_only PROPERTY LINK_LIBRARIES loom::mpi)
  add_test(NAME doc_training_loop.header_only
    COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:doc_training_loop_header_only>" "-DEXPECT_REGEX=${_expect}"
            -P ${PROJECT_SOURCE_DIR}/cmake/expect_success.cmake)
  set_tests_properties(doc_training_loop.header_only PROPERTIES LABELS "docs;model")
endif()
