//! A task's identity: what it asks the service for, and the bytes of the images it reads.
//!
//! Two tasks with the same identity are the same work, whichever run or pipeline file they
//! came from; that is what lets a changed pipeline keep its unchanged results and a new run
//! reuse an old one's. Input images count by their sha256, never their URL, which changes on
//! every refresh. An image given by URL in the pipeline file counts by its URL: imgpipe never
//! fetches such images itself.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::api::types::{GenerationRequest, ToolRequest};
use crate::plan::graph::{Graph, Source, Work};
use crate::sha256::Sha256Sum;
use crate::store::TaskId;

/// Bumped whenever the hashed form changes, so old identities stop matching rather than
/// matching wrongly.
const VERSION: &str = "imgpipe-task-identity/1";

/// The identity of task `t`, or `None` while an input image's bytes are unknown.
/// `input(task, k)` is the sha256 of output `k` of `task`, when it is known.
pub fn identity(
    graph: &Graph,
    t: usize,
    input: impl Fn(usize, u32) -> Option<Sha256Sum>,
) -> Option<String> {
    let work = graph.work(t).ok()?;
    let mut inputs = Vec::new();
    for source in work.sources() {
        inputs.push(match source {
            Source::Output { task, k } => format!("sha256:{}", input(*task, *k)?),
            Source::Url(u) => format!("url:{u}"),
        });
    }
    let request = request_body(&work);
    let canonical = serde_json::json!({
        "version": VERSION,
        "request": request,
        "inputs": inputs,
    });
    Some(hex::encode(Sha256::digest(
        canonical.to_string().as_bytes(),
    )))
}

/// The identity of task `t` as recorded: its inputs' bytes are those of the outputs recorded
/// for them. `row(task)` is the row a graph task is recorded as; `hashes` the sha256 of each
/// downloaded output by row and output index.
pub fn from_record(
    graph: &Graph,
    t: usize,
    row: impl Fn(usize) -> Option<TaskId>,
    hashes: &HashMap<(TaskId, u32), Sha256Sum>,
) -> Option<String> {
    identity(graph, t, |u, k| hashes.get(&(row(u)?, k)).cloned())
}

/// The request as it goes on the wire, with each input URL replaced by its position.
fn request_body(work: &Work) -> serde_json::Value {
    match work {
        Work::Generate {
            prompt,
            n,
            size,
            references,
        } => {
            let mut req = GenerationRequest::new(prompt.clone());
            req.n = *n;
            req.size = *size;
            req.image_urls = (0..references.len())
                .map(|i| format!("input:{i}"))
                .collect();
            serde_json::json!({ "endpoint": "generations", "body": req.to_body() })
        }
        Work::Tool {
            preserve_alpha,
            params,
            ..
        } => {
            let mut req = ToolRequest::new("input:0", params.clone());
            req.preserve_alpha = *preserve_alpha;
            serde_json::json!({ "endpoint": req.tool().as_str(), "body": req.to_body() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(text: &str) -> Graph {
        Graph::of_text(text)
    }

    fn chain(prompt: &str, increase: u8) -> Graph {
        graph(&format!(
            r#"
version: 1
name: t
items: [{{ id: a }}]
steps:
  - id: shot
    generate: {{ prompt: "{prompt}" }}
  - id: big
    upscale: {{ from: shot, desired_increase: {increase} }}
"#
        ))
    }

    #[test]
    fn a_task_is_known_by_its_request_and_its_inputs_bytes() {
        let g = chain("a mug", 2);
        let sha = |s: &'static str| move |_: usize, _: u32| Some(Sha256Sum::of_bytes(s.as_bytes()));
        let first = identity(&g, 1, sha("aa")).unwrap();
        // The same request on the same bytes is the same work, whatever the pipeline file.
        assert_eq!(identity(&chain("a mug", 2), 1, sha("aa")).unwrap(), first);
        // Other input bytes, or another parameter, is other work.
        assert_ne!(identity(&g, 1, sha("bb")).unwrap(), first);
        assert_ne!(identity(&chain("a mug", 4), 1, sha("aa")).unwrap(), first);
        // A generation reads no image: its prompt alone decides.
        let gen_id = identity(&g, 0, |_, _| None).unwrap();
        assert_ne!(
            identity(&chain("a lamp", 2), 0, |_, _| None).unwrap(),
            gen_id
        );
    }

    #[test]
    fn an_input_whose_bytes_are_unknown_leaves_the_identity_unknown() {
        let g = chain("a mug", 2);
        assert_eq!(identity(&g, 1, |_, _| None), None);
    }
}
