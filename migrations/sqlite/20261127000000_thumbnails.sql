-- The thumbnails a report put under the prefix of a run in object storage, and what each shows:
-- a report made again reads these a page at a time instead of the thumbnails, and lists
-- `_thumbs/` against them in the order of their names (the primary key's; SQLite's default
-- collation compares bytes, the order S3 lists keys in) to see they are still there.
CREATE TABLE thumbnails (
    run_id       TEXT NOT NULL REFERENCES runs(id),
    -- `<name>.png` under `<run>/_thumbs/`: the start of its image's sha256.
    name         TEXT NOT NULL,
    width        INTEGER NOT NULL,
    height       INTEGER NOT NULL,
    thumb_width  INTEGER NOT NULL,
    thumb_height INTEGER NOT NULL,
    alpha        INTEGER NOT NULL,
    -- The object's size and ETag as the store gave them when it was put.
    bytes        INTEGER NOT NULL,
    etag         TEXT,
    PRIMARY KEY (run_id, name)
);
