// Precompiled header of the fuzz build: the LibTorch headers the parsers include, without the
// c10d ones the main build's pch.h adds (no parser uses them).
#pragma once
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>
