// fake CUDA header for the CPU emulator: everything is in rammer_emu.h
#pragma once
#include "rammer_emu.h"
