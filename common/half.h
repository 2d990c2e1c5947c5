// The fp16/bf16 conversions live in the public header, where plugins find them.
#pragma once

#include "kiln/half.h"
