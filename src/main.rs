//! The `kvroute` binary: the command line in [`kvroute::cli`] (which sets up logging).

use std::process::ExitCode;

fn main() -> ExitCode {
    kvroute::cli::main()
}
