# Stands in for llama.cpp's scripts/ui-assets.cmake, which the pinned sdist leaves out:
# generates tools/ui's sources with no assets, so llama-server builds with its API only.
set(N_ASSETS 0)
set(ASSET_ARRAYS "")
set(ASSET_TABLE "")
set(USE_GZIP false)
unset(LLAMA_UI_HAS_ASSETS)
configure_file("${UI_SOURCE_DIR}/ui.h.in" "${UI_BINARY_DIR}/ui.h" @ONLY)
configure_file("${UI_SOURCE_DIR}/ui.cpp.in" "${UI_BINARY_DIR}/ui.cpp" @ONLY)
