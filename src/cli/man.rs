//! `imgpipe man --out DIR`: man pages made from the CLI's own definition (clap_mangen), one
//! for imgpipe and one per command (`imgpipe-run.1`, `imgpipe-cap-set.1`, …).

use std::path::{Path, PathBuf};

use clap::{Args, CommandFactory};

use crate::cli::{Cli, stdio};
use crate::error::Error;

#[derive(Debug, Args)]
pub struct ManArgs {
    /// The directory the pages are written to (made if missing), e.g. ~/.local/share/man/man1
    #[arg(long, value_name = "DIR", value_parser = crate::cli::args::out_path)]
    pub out: PathBuf,
}

pub(super) fn run(args: &ManArgs) -> Result<(), Error> {
    std::fs::create_dir_all(&args.out).map_err(|e| cannot_write(&args.out, &e))?;
    let mut command = Cli::command();
    command.build();
    let mut written = Vec::new();
    write_pages(&command, "imgpipe", &args.out, &mut written)?;
    for path in written {
        stdio::line(path.display().to_string())?;
    }
    Ok(())
}

/// The page of `command`, named `name`, then those of its subcommands, depth first.
fn write_pages(
    command: &clap::Command,
    name: &str,
    dir: &Path,
    written: &mut Vec<PathBuf>,
) -> Result<(), Error> {
    let page = command.clone().display_name(name.to_owned());
    let mut text = Vec::new();
    clap_mangen::Man::new(page)
        .render(&mut text)
        .map_err(|e| cannot_write(dir, &e))?;
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, text).map_err(|e| cannot_write(&path, &e))?;
    written.push(path);
    for sub in command.get_subcommands() {
        if sub.get_name() == "help" || sub.is_hide_set() {
            continue;
        }
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

fn cannot_write(path: &Path, e: &std::io::Error) -> Error {
    Error::Other(anyhow::anyhow!("cannot write {}: {e}", path.display()))
}
