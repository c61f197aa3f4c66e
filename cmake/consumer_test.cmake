# Installs loom into a scratch prefix and builds tests/consumer against it with find_package, then again with
# add_subdirectory; runs both.  cmake -DSRC=<loom source> -DBIN=<loom build> -DWORK=<scratch dir> -P consumer_test.cmake
file(REMOVE_RECURSE ${WORK})
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed: ${ARGN}\n${out}\n${err}")
  endif()
endfunction()
step(${CMAKE_COMMAND} --install ${BIN} --prefix ${WORK}/prefix)
step(${CMAKE_COMMAND} -S ${SRC}/tests/consumer -B ${WORK}/installed -DCMAKE_PREFIX_PATH=${WORK}/prefix)
step(${CMAKE_COMMAND} --build ${WORK}/installed)
step(${WORK}/installed/consumer)
step(${CMAKE_COMMAND} -S ${SRC}/tests/consumer -B ${WORK}/subdir -DLOOM_SOURCE_DIR=${SRC} -DLOOM_WITH_CUDA=OFF)
step(${CMAKE_COMMAND} --build ${WORK}/subdir --target consumer)
step(${WORK}/subdir/consumer)
message(STATUS "the installed package and add_subdirectory both work")
file(REMOVE_RECURSE ${WORK})  # kept only when a step failed
