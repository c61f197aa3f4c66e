// <loom/checkpoint.hpp>: Checkpoints: safetensors files, the GPT in Hugging Face's layout, and training state that resumes on any
// layout. Needs nlohmann-json (nlohmann_json::nlohmann_json).
#pragma once

#include <loom/checkpoint/safetensors.hpp>
#include <loom/checkpoint/gpt.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/checkpoint/trainer.hpp>
