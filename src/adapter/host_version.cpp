// The release number of the NIXL that loaded us, for messages and for the check that the
// symbols and the release agree. Sources, first that answers:
//   1. the wheel's metadata: libnixl of a pip wheel lives in site-packages/.<pkg>.mesonpy.libs,
//      and site-packages holds <pkg>-<version>.dist-info;
//   2. the library itself: some releases (0.10.1, 1.5.x) keep the string the agent logs at
//      start-up ("NIXL version: ") next to the release number in their read-only data.
#include "host_nixl.h"

#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>

namespace nf::adapter {
namespace {

namespace fs = std::filesystem;

// "1.5.1", "0.10.0", "1.6.0rc1": digits, a dot, digits, a dot, digits, then anything.
bool looks_like_version(std::string_view s) {
    int dots = 0;
    bool digit = false;
    for (char c : s) {
        if (std::isdigit(static_cast<unsigned char>(c))) {
            digit = true;
        } else if (c == '.' && digit && dots < 2) {
            ++dots;
            digit = false;
        } else {
            break;
        }
    }
    return dots == 2 && digit;
}

bool from_dist_info(const fs::path &lib, NixlFacts &facts) {
    const std::string dir = lib.parent_path().filename().string(); // .nixl_cu12.mesonpy.libs
    constexpr std::string_view suffix = ".mesonpy.libs";
    if (dir.size() <= suffix.size() + 1 || dir[0] != '.' ||
        dir.compare(dir.size() - suffix.size(), suffix.size(), suffix) != 0)
        return false;
    const std::string pkg = dir.substr(1, dir.size() - 1 - suffix.size()) + "-";
    std::error_code ec;
    for (fs::directory_iterator it(lib.parent_path().parent_path(), ec), end; !ec && it != end;
         it.increment(ec)) {
        const std::string name = it->path().filename().string();
        constexpr std::string_view info = ".dist-info";
        if (name.size() > pkg.size() + info.size() && name.compare(0, pkg.size(), pkg) == 0 &&
            name.compare(name.size() - info.size(), info.size(), info) == 0) {
            const std::string v = name.substr(pkg.size(), name.size() - pkg.size() - info.size());
            if (!looks_like_version(v))
                continue;
            facts.version = v;
            facts.version_source = it->path().string();
            return true;
        }
    }
    return false;
}

bool from_library_text(const fs::path &lib, NixlFacts &facts) {
    std::ifstream in(lib, std::ios::binary);
    if (!in)
        return false;
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    constexpr std::string_view tag("NIXL version: \0", 15);
    const size_t at = data.find(tag);
    if (at == std::string::npos)
        return false;
    // The number is one of the next few NUL-terminated strings.
    size_t p = at + tag.size();
    for (int i = 0; i < 4 && p < data.size(); ++i) {
        const size_t end = data.find('\0', p);
        const std::string_view s(data.data() + p, (end == std::string::npos ? data.size() : end) - p);
        if (looks_like_version(s) && s.size() < 32) {
            facts.version = std::string(s);
            facts.version_source = lib.string();
            return true;
        }
        if (end == std::string::npos)
            break;
        p = end + 1;
    }
    return false;
}

} // namespace

void find_version(const std::string &libnixl, NixlFacts &facts) {
    try {
        const fs::path lib(libnixl);
        if (!from_dist_info(lib, facts))
            from_library_text(lib, facts);
    } catch (...) {
        // No version is a fact the classifier handles, not an error.
    }
}

} // namespace nf::adapter
