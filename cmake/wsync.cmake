include(GoogleTest)

# wsync_cc_library(NAME name SRCS ... DEPS ...): one static library per area.
function(wsync_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_library(${A_NAME} STATIC ${A_SRCS})
  target_include_directories(${A_NAME} PUBLIC ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${A_NAME} PUBLIC ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
endfunction()

# wsync_cc_test(NAME name SRCS ... DEPS ... [LABELS ...] [TIMEOUT s]): a GoogleTest binary,
# registered with CTest test by test. Every test sees WSYNC_BIN (the CLI) and
# WSYNC_SOURCE_DIR in its environment.
#
# LABELS and ENVIRONMENT are lists, which gtest_discover_tests(PROPERTIES) would split
# into separate words (CMake 3.25); they are set instead from a file CTest includes after
# discovery, walking the <name>_TESTS list that discovery fills.
function(wsync_cc_test)
  cmake_parse_arguments(A "" "NAME;TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_include_directories(${A_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main)
  target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 300)
  endif()
  gtest_discover_tests(${A_NAME} TEST_LIST ${A_NAME}_TESTS
    PROPERTIES TIMEOUT ${A_TIMEOUT}
    DISCOVERY_TIMEOUT 60)
  set(env "WSYNC_BIN=${PROJECT_BINARY_DIR}/tools/wsync;WSYNC_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
  set(file "${CMAKE_CURRENT_BINARY_DIR}/${A_NAME}_properties.cmake")
  set(props "ENVIRONMENT \"${env}\"")
  if(A_LABELS)
    string(APPEND props " LABELS \"${A_LABELS}\"")
  endif()
  file(WRITE "${file}"
       "foreach(t IN LISTS ${A_NAME}_TESTS)\n"
       "  set_tests_properties(\"\${t}\" PROPERTIES ${props})\n"
       "endforeach()\n")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${file}")
endfunction()

# wsync_fuzz_target(NAME name SRCS ... DEPS ...): a fuzz target for a parser of untrusted
# bytes, defining LLVMFuzzerTestOneInput. Its checked-in seeds live in fuzz/corpus/<name>/
# (every crash found becomes a seed there and a unit test beside the code). With
# WSYNC_FUZZ (clang) it links libFuzzer and `make fuzz` runs it; otherwise it links
# fuzz/driver.cc, which runs each seed once. Either way CTest runs every seed once
# (test fuzz_seeds.<name>, label "fuzz"), so a fixed crash stays fixed in every build.
function(wsync_fuzz_target)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  if(WSYNC_FUZZ)
    add_executable(${A_NAME} ${A_SRCS})
    target_link_options(${A_NAME} PRIVATE -fsanitize=fuzzer)
  else()
    add_executable(${A_NAME} ${A_SRCS} ${PROJECT_SOURCE_DIR}/fuzz/driver.cc)
  endif()
  target_include_directories(${A_NAME} PRIVATE ${PROJECT_SOURCE_DIR}/include ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS})
  target_compile_options(${A_NAME} PRIVATE -Wall -Wextra -Wno-unused-parameter)
  set(corpus ${PROJECT_SOURCE_DIR}/fuzz/corpus/${A_NAME})
  if(NOT IS_DIRECTORY ${corpus})
    message(FATAL_ERROR "fuzz target ${A_NAME} has no seed corpus at ${corpus}")
  endif()
  add_test(NAME fuzz_seeds.${A_NAME} COMMAND ${A_NAME} -runs=0 ${corpus})
  set_tests_properties(fuzz_seeds.${A_NAME} PROPERTIES LABELS fuzz TIMEOUT 300)
  set_property(GLOBAL APPEND PROPERTY WSYNC_FUZZ_TARGETS ${A_NAME})
endfunction()
