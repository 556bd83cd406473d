#include "python/dlpack.h"
