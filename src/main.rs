//! The `kvroute` binary: the command line in [`kvroute::cli`] (which sets up logging).

use std::process::ExitCode;

/// jemalloc rather than glibc's allocator. Each proxied request frees and takes again a few
/// buffers of several KiB (hyper's 8 KiB read buffer, the boxed request future), sizes that
/// glibc's per-thread cache does not hold and jemalloc's does. Measured side by side in
/// `docs/measurements.md` ("jemalloc as the allocator").
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    kvroute::cli::main()
}
