//! Every outcome of the review, decided from records written by hand: no database, no
//! network, no disk.

use std::collections::HashMap;

use super::*;
use crate::api::job_id::JobId;
use crate::resume::check::{Found, differs};
use crate::sha256::Sha256Sum;
use crate::store::{AttemptId, CallOutcome, LastAttempt, OutputId, ReusableOutput};
use crate::task_key::TaskKey;

/// Two items, each generated once (n: 2) and each image upscaled: per item 1 + 2 tasks.
const CHAIN: &str = r#"
version: 1
name: t
items: [{ id: a }, { id: b }]
steps:
  - id: shot
    generate: { prompt: "shot {{ item.id }}", n: 2 }
  - id: big
    upscale: { from: shot, desired_increase: 2 }
"#;

fn graph() -> Graph {
    Graph::of_text(CHAIN)
}

fn task(g: &Graph, item: &str, step: &str, idx: u32) -> usize {
    g.index().get(item, step, idx).expect("a task of the chain")
}

fn row(g: &Graph, t: usize, status: TaskStatus, attempt: Option<LastAttempt>) -> RecordedTask {
    RecordedTask {
        id: row_id(t),
        key: g.key(t),
        status,
        planned_credits: g.task(t).planned,
        credits_billed: 0,
        job_id: None,
        error: (status == TaskStatus::Failed).then(|| "HTTP 500".to_owned()),
        last_attempt: attempt,
        identity: None,
        reused_from: None,
    }
}

/// A sha256 made of `text`, for a test's outputs.
fn sha(text: &str) -> Sha256Sum {
    Sha256Sum::of_bytes(text.as_bytes())
}

fn row_id(t: usize) -> TaskId {
    TaskId::new(100 + t as i64).unwrap()
}

/// Records of a run in which every task of `recorded` items has a row: succeeded unless
/// `open` gives its row.
fn records(g: &Graph, recorded: &[&str], open: Vec<RecordedTask>) -> Records {
    let mut r = Records::empty(g);
    for t in 0..g.len() {
        let item = g.key(t).item;
        if recorded.contains(&item.as_str()) {
            r.ids.set(t, row_id(t));
            if let Instance::Item(i) = g.task(t).instance {
                r.has_rows[i] = true;
            }
        }
    }
    for o in open {
        let t = task(g, &o.key.item, &o.key.step, o.key.index);
        r.open.insert(t, o);
    }
    r
}

const RETRY: Options = Options {
    on_ambiguous: OnAmbiguous::Retry,
    reuse: false,
};

fn done(d: Decision) -> Review {
    match d {
        Decision::Done(r) => *r,
        Decision::Need(ids) => panic!("asked for {ids:?}"),
    }
}

fn reasons(r: &Review) -> Vec<(usize, Reason)> {
    r.redo.iter().map(|x| (x.task, x.reason)).collect()
}

#[test]
fn a_finished_item_is_kept_whole_and_an_unreached_one_counted_not_listed() {
    let g = graph();
    let rec = records(&g, &["a"], Vec::new());
    let r = done(decide(&g, &rec, RETRY, &Lookups::default()));
    assert_eq!(r.kept, [0, 1, 2].map(row_id));
    assert!(r.redo.is_empty());
    assert_eq!(r.unrecorded.instances, vec![Instance::Item(1)]);
    assert_eq!((r.unrecorded.tasks, r.to_pay()), (3, 3));
    assert_eq!(r.credits(), 4 * 2 + 2 * 2);
    assert!(r.recover.is_empty() && r.reuse.is_empty() && r.left_failed.is_empty());
}

#[test]
fn each_open_task_is_paid_again_for_its_own_reason() {
    let g = graph();
    let (shot, big0, big1) = (
        task(&g, "a", "shot", 0),
        task(&g, "a", "big", 0),
        task(&g, "a", "big", 1),
    );
    let answered = LastAttempt {
        id: AttemptId::new(7).unwrap(),
        outcome: Some(CallOutcome::AnsweredError),
        job_id: None,
    };
    let open = vec![
        row(&g, shot, TaskStatus::Failed, Some(answered)),
        row(&g, big0, TaskStatus::Blocked, None),
        row(&g, big1, TaskStatus::Pending, None),
    ];
    let rec = records(&g, &["a", "b"], open);
    let r = done(decide(&g, &rec, RETRY, &Lookups::default()));
    assert_eq!(
        reasons(&r),
        vec![
            (shot, Reason::Failed),
            (big0, Reason::Blocked),
            (big1, Reason::NeverStarted)
        ]
    );
    assert_eq!(r.redo[0].detail.as_deref(), Some("HTTP 500"));
    assert_eq!(r.kept.len(), 3, "item b is kept whole");
}

#[test]
fn a_lost_answer_naming_its_job_is_read_back_and_one_without_is_ambiguous() {
    let g = graph();
    let (named, unnamed) = (task(&g, "a", "shot", 0), task(&g, "b", "shot", 0));
    let lost = |id, job: Option<&str>| LastAttempt {
        id: AttemptId::new(id).unwrap(),
        outcome: None,
        job_id: job.map(JobId::from),
    };
    let open = vec![
        row(&g, named, TaskStatus::Running, Some(lost(1, Some("job_1")))),
        row(&g, unnamed, TaskStatus::Running, Some(lost(2, None))),
    ];
    let rec = records(&g, &["a", "b"], open);
    let r = done(decide(&g, &rec, RETRY, &Lookups::default()));
    assert_eq!(
        reasons(&r),
        vec![(named, Reason::Ambiguous), (unnamed, Reason::Ambiguous)]
    );
    assert_eq!(r.recover.len(), 1);
    assert_eq!(
        (
            r.recover[0].task,
            r.recover[0].attempt_id,
            r.recover[0].job_id.as_str()
        ),
        (named, AttemptId::new(1).unwrap(), "job_1")
    );
}

#[test]
fn on_ambiguous_fail_leaves_the_task_failed_and_blocks_what_is_below_it() {
    let g = graph();
    let shot = task(&g, "a", "shot", 0);
    let (big0, big1) = (task(&g, "a", "big", 0), task(&g, "a", "big", 1));
    let lost = LastAttempt {
        id: AttemptId::new(3).unwrap(),
        outcome: Some(CallOutcome::Ambiguous),
        job_id: None,
    };
    let open = vec![
        row(&g, shot, TaskStatus::Running, Some(lost)),
        row(&g, big0, TaskStatus::Pending, None),
        row(&g, big1, TaskStatus::Pending, None),
    ];
    let rec = records(&g, &["a", "b"], open);
    let fail = Options {
        on_ambiguous: OnAmbiguous::Fail,
        reuse: false,
    };
    let r = done(decide(&g, &rec, fail, &Lookups::default()));
    assert_eq!(r.left_failed.len(), 1);
    assert_eq!(r.left_failed[0].task, shot);
    assert!(
        r.redo.is_empty(),
        "the upscales below it are blocked, not paid"
    );
}

#[test]
fn a_changed_pipeline_keeps_tasks_of_the_same_identity_and_pays_for_the_others() {
    let g = graph();
    let mut rec = records(&g, &["a", "b"], Vec::new());
    // The shots' bytes are known; the upscales of item a were recorded under another request.
    for item in ["a", "b"] {
        let id = row_id(task(&g, item, "shot", 0));
        rec.hashes.insert((id, 0), sha(&format!("{item}0")));
        rec.hashes.insert((id, 1), sha(&format!("{item}1")));
    }
    let known = |t: usize, k: u32| -> Option<Sha256Sum> {
        let item = g.key(t).item;
        Some(sha(&format!("{item}{k}")))
    };
    let mut previous = HashMap::new();
    for t in 0..g.len() {
        let TaskKey { item, step, .. } = g.key(t);
        let same = identity(&g, t, known);
        let was = if item == "a" && step == "big" {
            Some("another request".to_owned())
        } else {
            same
        };
        previous.insert(row_id(t), was);
    }
    rec.previous = Some(previous);
    let r = done(decide(&g, &rec, RETRY, &Lookups::default()));
    assert!(r.changes);
    let big = [task(&g, "a", "big", 0), task(&g, "a", "big", 1)];
    assert_eq!(
        reasons(&r),
        vec![(big[0], Reason::Changed), (big[1], Reason::Changed)]
    );
    assert_eq!(r.kept.len(), 4);
}

#[test]
fn reuse_asks_for_each_level_of_the_chain_in_one_batch_and_takes_what_it_finds() {
    let g = graph();
    // A new run: nothing recorded; every task may come from an earlier run.
    let rec = records(&g, &[], Vec::new());
    let opts = Options {
        on_ambiguous: OnAmbiguous::Retry,
        reuse: true,
    };
    let mut lookups = Lookups::default();
    let Decision::Need(first) = decide(&g, &rec, opts, &lookups) else {
        panic!("the shots' identities are asked for first");
    };
    assert_eq!(
        first.len(),
        2,
        "one question per shot, all at once: {first:?}"
    );
    // Item a's shot was made by an earlier run; item b's never was.
    let shot_a = identity(&g, task(&g, "a", "shot", 0), |_, _| None).unwrap();
    let earlier = Reusable {
        task_id: TaskId::new(9).unwrap(),
        run_id: "earlier".into(),
        job_id: "job_9".into(),
        outputs: (0..2)
            .map(|k| ReusableOutput {
                k,
                url: format!("https://x/{k}"),
                url_issued_at: 0,
                path: None,
                sha256: Some(sha(&format!("sha{k}"))),
                bytes: None,
                parent_job_id: None,
            })
            .collect(),
    };
    lookups.answer(first, HashMap::from([(shot_a.clone(), earlier)]));
    let Decision::Need(second) = decide(&g, &rec, opts, &lookups) else {
        panic!("the upscales of the reused shot can now be looked up");
    };
    assert_eq!(second.len(), 2, "{second:?}");
    lookups.answer(second, HashMap::new());
    let r = done(decide(&g, &rec, opts, &lookups));
    assert_eq!(r.reuse.len(), 1);
    assert_eq!(r.reuse[0].1, shot_a);
    assert_eq!(r.saved_by_reuse(&g), 8);
    assert_eq!(r.to_pay(), 5, "b's chain and a's two upscales");
}

#[test]
fn recorded_tasks_the_pipeline_dropped_are_passed_on() {
    let g = graph();
    let mut rec = records(&g, &["a", "b"], Vec::new());
    let row = row(&g, 0, TaskStatus::Succeeded, None);
    let gone = RecordedTask {
        key: TaskKey::new("c", row.key.step.as_str(), row.key.index),
        ..row
    };
    rec.removed.push(gone);
    let r = done(decide(&g, &rec, RETRY, &Lookups::default()));
    assert_eq!(r.removed.len(), 1);
    assert_eq!(r.to_pay(), 0);
}

#[test]
fn an_output_is_fetched_again_when_missing_and_set_aside_when_modified() {
    let (one, abc, def) = (OutputId::new(1).unwrap(), sha("abc"), sha("def"));
    assert!(differs(one, &abc, Found::Bytes(abc.clone())).is_none());
    let missing = differs(one, &abc, Found::Missing).expect("fetched again");
    assert_eq!(missing.modified, None);
    let modified = differs(one, &abc, Found::Bytes(def.clone())).expect("set aside");
    assert_eq!((modified.id, modified.modified), (one, Some(def)));
}
