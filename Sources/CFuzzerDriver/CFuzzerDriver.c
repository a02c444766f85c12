// Declarations only (include/CFuzzerDriver.h): libFuzzer defines the function when linked in.
#include "CFuzzerDriver.h"
