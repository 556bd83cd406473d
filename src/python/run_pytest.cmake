# Runs one pytest file: cmake -DPYTHON=... -DTEST=... -P run_pytest.cmake. Exit code 5
# (nothing collected) passes; any other non-zero fails the CTest test.
execute_process(COMMAND ${PYTHON} -m pytest -q -p no:cacheprovider ${TEST} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 AND NOT rc EQUAL 5)
  message(FATAL_ERROR "pytest ${TEST} exited with ${rc}")
endif()
