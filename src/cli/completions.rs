//! `imgpipe completions SHELL`: the shell's completion script, made from the CLI's own
//! definition (clap_complete), on stdout.

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use crate::cli::{Cli, stdio};
use crate::error::Error;

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish or powershell (elvish too)
    #[arg(value_enum)]
    pub shell: Shell,
}

pub(super) fn run(args: &CompletionsArgs) -> Result<(), Error> {
    let mut command = Cli::command();
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "imgpipe", &mut script);
    stdio::print(&String::from_utf8_lossy(&script))
}
