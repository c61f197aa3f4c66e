# The number of train_gpt's layouts that README.md and docs/build.md state is the number of layouts it compiles (the
# list its refusal prints, which train_gpt_rejects checks against the build).
#   cmake "-DLAYOUTS=<the list, ', '-separated>" -DROOT=<source dir> -P this
string(REPLACE ", " ";" list "${LAYOUTS}")
list(LENGTH list n)
foreach(check "README.md|train_gpt`'s[ \n]+([0-9]+) layouts" "docs/build.md|train_gpt compiles its[ \n]+([0-9]+)[ \n]+layouts")
  string(REPLACE "|" ";" c "${check}")
  list(GET c 0 file)
  list(GET c 1 pattern)
  file(READ ${ROOT}/${file} text)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "${file} does not say how many layouts train_gpt compiles ('${pattern}')")
  endif()
  if(NOT CMAKE_MATCH_1 EQUAL n)
    message(FATAL_ERROR "${file} says train_gpt compiles ${CMAKE_MATCH_1} layouts; it compiles ${n}")
  endif()
endforeach()
message(STATUS "README.md and docs/build.md: ${n} layouts, as compiled")
