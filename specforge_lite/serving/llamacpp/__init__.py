"""llama.cpp in the loop: GGUF exports of our drafters and llama.cpp as an evaluation backend."""
