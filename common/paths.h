// Where kiln keeps its files. Environment overrides first, then XDG, then the fallbacks.
#pragma once

#include <filesystem>

#include "kiln/status.h"

namespace kiln {

// $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln.
std::filesystem::path cache_dir();
// cache_dir()/kernels.sqlite
std::filesystem::path cache_file();
// $XDG_RUNTIME_DIR/kiln, else /tmp/kiln-<uid>.
std::filesystem::path runtime_dir();
// $KILN_SOCKET, else runtime_dir()/kilnd.sock.
std::filesystem::path socket_path();

// Creates `dir` (and parents) if needed with mode 0700, then checks that it is a real directory
// (not a symlink), owned by this user, with no group or other permissions.
Status ensure_private_dir(const std::filesystem::path& dir);

}  // namespace kiln
