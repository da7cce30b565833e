use clap::Parser;

fn main() -> std::process::ExitCode {
    imgpipe::cli::run(imgpipe::cli::Cli::parse())
}
