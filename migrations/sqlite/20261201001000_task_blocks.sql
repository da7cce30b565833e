-- A run records its items' tasks a chunk of items at a time, one statement each, in the
-- graph's order: a chunk recorded whole is a block of consecutive row ids. The executor writes
-- a row here for each such block, after its tasks are committed, with the pipeline and items
-- it was recorded from; a takeover then knows the row id of every task of the night from a
-- row per block, and reads whole only what no block holds (the batch, a chunk recorded in
-- part, the tasks not succeeded), never every task of the run once. A block of another
-- pipeline or items (`--allow-changes`) is not read; nor are blocks that, with the rows read,
-- do not account for every live task the run's totals count: the run's rows are then read
-- item by item as before.
-- Append-only, like every migration.

CREATE TABLE task_blocks (
    run_id           TEXT NOT NULL,
    -- The block's first item, by its place in the items file (the graph's order).
    first_item       BIGINT NOT NULL,
    items            BIGINT NOT NULL,
    -- The row id of the block's first task; its tasks are first_id, first_id + 1, … in the
    -- graph's order.
    first_id         BIGINT NOT NULL,
    tasks            BIGINT NOT NULL,
    pipeline_sha256  TEXT NOT NULL,
    items_sha256     TEXT NOT NULL,
    PRIMARY KEY (run_id, first_item)
);
