//! `imgpipe schema`: the JSON Schema of pipeline files, from the types that parse them.

use crate::cli::stdio;
use crate::error::Error;

pub(super) fn run() -> Result<(), Error> {
    let schema = crate::pipeline::spec::json_schema();
    let text = serde_json::to_string_pretty(&schema)
        .map_err(|e| Error::Other(anyhow::anyhow!("cannot print the schema: {e}")))?;
    stdio::line(&text)?;
    Ok(())
}
