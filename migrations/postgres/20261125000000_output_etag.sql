-- The ETag the store gave an output's object when it was uploaded (object storage only; NULL
-- for a local file and for outputs recorded before this column). A resume lists the run's
-- prefix and compares each object's key, size and ETag with the record, so only the objects
-- that disagree are looked at one by one. Append-only, like every migration.
ALTER TABLE outputs ADD COLUMN etag TEXT;
