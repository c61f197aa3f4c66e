# Tensors, data, checkpoints, the GPT model and train_gpt.
if(nlohmann_json_FOUND)
  loom_add_test(test_tensor test_tensor.cpp LIBS nlohmann_json::nlohmann_json LABELS model)
endif()
