// <loom/checkpoint.hpp>: Checkpoints: safetensors files, training state that resumes on any layout, for any model
// with model_config, write_model and read_model (checkpoint::CheckpointModel), and the library's transformers in
// Hugging Face's layout (models/gpt/checkpoint.hpp). Needs nlohmann-json (nlohmann_json::nlohmann_json).
#pragma once

#include <loom/checkpoint/safetensors.hpp>
#include <loom/checkpoint/training.hpp>
#include <loom/checkpoint/trainer.hpp>
#include <loom/models/gpt/checkpoint.hpp>
