// WSYNC_SANITIZED is defined in code built with AddressSanitizer (`make test-asan`, any
// build with -fsanitize=address, GCC or clang). Tests whose assertion is a timing (a
// throughput floor, a page probe timed in microseconds) skip themselves there: the
// sanitizers change how long things take, not what they do.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define WSYNC_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define WSYNC_SANITIZED 1
#endif
#endif
