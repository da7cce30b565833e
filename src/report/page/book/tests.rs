use super::*;
use crate::place::Address;
use crate::store::{OutputId, TaskId, TaskStatus};

fn task(id: i64, item: &str) -> ReportTask {
    ReportTask {
        id: TaskId::new(id).unwrap(),
        item: item.to_owned(),
        step: "s".to_owned(),
        idx: 0,
        operation: "generate".to_owned(),
        inputs: Vec::new(),
        status: TaskStatus::Succeeded,
        planned_credits: 1,
        credits_billed: 1,
        job_id: None,
        error: None,
        removed: false,
        reused_from_run: None,
        attempts: 1,
        request: None,
    }
}

fn output(id: i64, k: u32, path: Option<&str>) -> ReportOutput {
    ReportOutput {
        id: OutputId::new(id).unwrap(),
        k,
        job_id: format!("j{id}").into(),
        place: path.map(Address::recorded),
        sha256: path.map(|p| crate::sha256::Sha256Sum::of_bytes(p.as_bytes())),
        download_error: None,
    }
}

fn row(task_id: i64, item: &str, out: Option<(u32, Option<&str>)>) -> ReportEntry {
    ReportEntry {
        task: task(task_id, item),
        output: out.map(|(k, path)| output(task_id * 10 + i64::from(k), k, path)),
    }
}

fn earlier(task_id: i64, path: Option<&str>) -> EarlierOutput {
    EarlierOutput {
        task_id: TaskId::new(task_id).unwrap(),
        k: 0,
        job_id: "old".into(),
        place: path.map(Address::recorded),
        sha256: None,
        reason: "rerolled".to_owned(),
        superseded_at: 0,
    }
}

fn ids(tasks: &[ReportTask]) -> Vec<i64> {
    tasks.iter().map(|t| t.id.get()).collect()
}

#[test]
fn group_keeps_items_in_arrival_order_and_sorts_tasks_and_outputs_within() {
    let rows = vec![
        row(5, "b", Some((1, Some("b1")))),
        row(4, "b", None),
        row(5, "b", Some((0, Some("b0")))),
        row(2, "a", Some((0, None))),
        row(1, "a", None),
    ];
    let g = group(rows, &[], 1);
    assert_eq!(ids(&g.tasks), vec![4, 5, 1, 2]);
    assert_eq!(g.borrowed, 0);
    let outs: Vec<(usize, u32)> = g.outputs.iter().map(|(t, o)| (*t, o.k)).collect();
    assert_eq!(outs, vec![(1, 0), (1, 1), (3, 0)]);
}

#[test]
fn a_later_page_starts_with_the_batch_and_the_first_does_not() {
    let batch = vec![task(1, layout::BATCH)];
    let g = group(vec![row(9, "z", None)], &batch, 2);
    assert_eq!(ids(&g.tasks), vec![1, 9]);
    assert_eq!(g.borrowed, 1);
    let g = group(vec![row(9, "z", None)], &batch, 1);
    assert_eq!(ids(&g.tasks), vec![9]);
    assert_eq!(g.borrowed, 0);
}

#[test]
fn a_batch_task_on_a_later_page_is_a_new_task_not_the_borrowed_one() {
    // The first task of a later page is pushed even when its id equals the last borrowed one.
    let batch = vec![task(3, layout::BATCH)];
    let g = group(vec![row(3, "x", Some((0, Some("x"))))], &batch, 2);
    assert_eq!(ids(&g.tasks), vec![3, 3]);
    assert_eq!(g.outputs[0].0, 1);
}

#[test]
fn batch_of_keeps_only_the_batch_tasks() {
    let tasks = vec![task(1, layout::BATCH), task(2, "a"), task(3, layout::BATCH)];
    assert_eq!(ids(&batch_of(&tasks)), vec![1, 3]);
}

#[test]
fn earlier_versions_are_previewed_only_on_this_machine() {
    let outputs = vec![(0, output(1, 0, Some("o.png"))), (0, output(2, 1, None))];
    let was = vec![(0, earlier(1, Some("old.png"))), (0, earlier(1, None))];
    let names = |local| -> Vec<PathBuf> {
        files_to_preview(&outputs, &was, local)
            .into_iter()
            .map(|(p, _)| p)
            .collect()
    };
    assert_eq!(
        names(true),
        vec![PathBuf::from("o.png"), PathBuf::from("old.png")]
    );
    assert_eq!(names(false), vec![PathBuf::from("o.png")]);
}

#[test]
fn attach_hands_out_previews_in_the_order_they_were_asked_for() {
    let outputs = vec![
        (0, output(1, 0, Some("o.png"))),
        (0, output(2, 1, None)),
        (1, output(3, 0, Some("p.png"))),
    ];
    let was = vec![(1, earlier(3, Some("old.png")))];
    let preview = |note: &str, made: bool| Preview {
        note: Some(note.to_owned()),
        made,
        on_disk: true,
        ..Preview::default()
    };
    let previews = vec![
        preview("o", true),
        preview("p", false),
        preview("old", true),
    ];
    let a = attach(outputs, was, previews, true);
    let notes = |t: usize| -> Vec<Option<String>> {
        a.shown[&t].iter().map(|s| s.preview.note.clone()).collect()
    };
    assert_eq!(notes(0), vec![Some("o".to_owned()), None]);
    assert_eq!(notes(1), vec![Some("p".to_owned())]);
    assert_eq!(a.earlier[&1][0].preview.note.as_deref(), Some("old"));
    assert_eq!((a.images, a.made), (2, 2));
}

#[test]
fn attach_gives_no_preview_to_earlier_versions_of_a_run_elsewhere() {
    let was = vec![(0, earlier(1, Some("old.png")))];
    let a = attach(Vec::new(), was, Vec::new(), false);
    assert_eq!(a.earlier[&0][0].preview, Preview::default());
    assert_eq!((a.images, a.made), (0, 0));
}
