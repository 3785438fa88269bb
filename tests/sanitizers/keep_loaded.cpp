// Note [Components kept loaded under LeakSanitizer]
// Open MPI 4.1 and hwloc dlopen their components and plugins and dlclose those they do not pick,
// and Open MPI 4.1 has no parameter to keep them (mca_base_component_disable_dlclose came with
// 5.0; setting it is silently ignored). A block one of them allocated and kept then shows, in a
// leak report, a frame in memory no longer mapped: "<unknown module>", which no suppression in
// tests/sanitizers/lsan.supp can name. In the AddressSanitizer build (only there: CMakeLists.txt
// adds this file to the library when MNIST_MPI_SANITIZE has "address") dlclose keeps every library
// loaded, as valgrind users do for the same reason, so that the first frame of such a block is in
// its component (mca_*.so) and the fast unwinder's short stacks are enough to match it. Nothing
// this program or its tests do depends on a library being unloaded.
// (No <dlfcn.h> here: its declaration of dlclose carries glibc's attributes.)
extern "C" int dlclose(void*) { return 0; }
