-- The thumbnails a report put under the prefix of a run in object storage, and what each shows:
-- a report made again reads these a page at a time instead of the thumbnails, and lists
-- `_thumbs/` against them in the order of their names (the primary key's, COLLATE "C": the order
-- S3 lists keys in, whatever the database's collation) to see they are still there.
CREATE TABLE thumbnails (
    run_id       TEXT NOT NULL REFERENCES runs(id),
    -- `<name>.png` under `<run>/_thumbs/`: the start of its image's sha256.
    name         TEXT COLLATE "C" NOT NULL,
    width        BIGINT NOT NULL,
    height       BIGINT NOT NULL,
    thumb_width  BIGINT NOT NULL,
    thumb_height BIGINT NOT NULL,
    alpha        BIGINT NOT NULL,
    -- The object's size and ETag as the store gave them when it was put.
    bytes        BIGINT NOT NULL,
    etag         TEXT,
    PRIMARY KEY (run_id, name)
);
