# Included right after llama.cpp's own project() call when llama-cpp-python builds it
# (scripts/setup_llamacpp.sh passes -DCMAKE_PROJECT_llama.cpp_INCLUDE=<this file>).
# llama-cpp-python's CMakeLists.txt forces LLAMA_BUILD_COMMON ON (CACHE ... FORCE), which builds
# llama.cpp's `common` library and cpp-httplib: the CLI tools' argument parser, chat templates,
# downloads, none of which the Python bindings load (they dlopen libllama and ggml only). Forcing it
# back OFF here, before llama.cpp's option() reads it, leaves libllama + ggml: about a third of the
# compile steps fewer.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp: build the common utils library (not needed by the bindings)" FORCE)
