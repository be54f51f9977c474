"""Loading a model: a folder of safetensors, a GGUF file, the hub cache, random weights of the model's
shape, and the converted-model cache; loader.load_model is the entry point."""
