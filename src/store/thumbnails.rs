//! The thumbnails a report put under the prefix of a run in object storage, and what each
//! shows (its image's size, its own, whether it has alpha), with the size and ETag the store
//! gave it. A report made again learns from here, a page at a time, what it would otherwise
//! read from the thumbnails themselves, and checks they are still there with a listing of
//! `_thumbs/` compared with these rows in the order of their names: nothing of the run's
//! thumbnails is held whole, in the database's client or in the bucket.

use crate::run_id::RunId;
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use sqlx::Row;

use crate::store::to_u64;
use crate::store::{Store, StoreError, rows};

/// A thumbnail under `<run>/_thumbs/`, named `<name>.png`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Thumbnail {
    /// Its name less `.png`: the start of its image's sha256.
    pub name: String,
    /// Its image's size.
    pub size: (u32, u32),
    /// Its own size.
    pub thumb_size: (u32, u32),
    pub alpha: bool,
    /// The object's size and ETag as the store gave them when it was put.
    pub bytes: u64,
    pub etag: Option<String>,
}

const COLUMNS: &str = "name, width, height, thumb_width, thumb_height, alpha, bytes, etag";

/// Thumbnails read in one statement when they are listed in order.
const PER_PAGE: i64 = 1000;

/// Rows a statement writes, or names it looks up (9 values a row: under SQLite's and
/// PostgreSQL's limits on bound values).
const PER_STATEMENT: usize = 200;

fn thumbnail_row(r: &sqlx::any::AnyRow) -> Result<Thumbnail, StoreError> {
    let number = |c: &str| -> Result<u32, StoreError> {
        let n: i64 = r.try_get(c)?;
        u32::try_from(n).map_err(|_| StoreError::Inconsistent(format!("thumbnail {c} is {n}")))
    };
    Ok(Thumbnail {
        name: r.try_get("name")?,
        size: (number("width")?, number("height")?),
        thumb_size: (number("thumb_width")?, number("thumb_height")?),
        alpha: r.try_get::<i64, _>("alpha")? != 0,
        bytes: to_u64(r.try_get("bytes")?),
        etag: r.try_get("etag")?,
    })
}

impl Store {
    /// The thumbnails a report put in object storage, and what each shows.
    pub fn thumbnails(&self) -> Thumbnails<'_> {
        Thumbnails { store: self }
    }
}

/// The thumbnails a report put in object storage, and what each shows.
#[derive(Clone, Copy, Debug)]
pub struct Thumbnails<'a> {
    store: &'a Store,
}

impl<'a> Thumbnails<'a> {
    /// The run's thumbnails in the byte order of their names (the order S3 lists them in; the
    /// PostgreSQL column is `COLLATE "C"`), a page of [`PER_PAGE`] at a time from where the
    /// last ended: a seek in the primary key each.
    pub fn list(self, run_id: &'a RunId) -> BoxStream<'a, Result<Thumbnail, StoreError>> {
        let sql = format!(
            "SELECT {COLUMNS} FROM thumbnails WHERE run_id = $1 AND name > $2
             ORDER BY name LIMIT $3"
        );
        futures::stream::try_unfold(Some(String::new()), move |after| {
            let sql = sql.clone();
            async move {
                let Some(after) = after else {
                    return Ok::<_, StoreError>(None);
                };
                // A fixed text: no value is ever part of it.
                let query = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(run_id)
                    .bind(after)
                    .bind(PER_PAGE);
                let page = self
                    .store
                    .fetch_unsorted(query)
                    .await?
                    .iter()
                    .map(thumbnail_row)
                    .collect::<Result<Vec<_>, _>>()?;
                if page.is_empty() {
                    return Ok(None);
                }
                let next = (page.len() as i64 == PER_PAGE)
                    .then(|| page.last().map(|t| t.name.clone()))
                    .flatten();
                let page = futures::stream::iter(page.into_iter().map(Ok::<_, StoreError>));
                Ok(Some((page, next)))
            }
        })
        .try_flatten()
        .boxed()
    }

    /// The run's thumbnails of these names; a name with none is left out.
    pub async fn named(
        &self,
        run_id: &RunId,
        names: &[String],
    ) -> Result<Vec<Thumbnail>, StoreError> {
        let mut found = Vec::new();
        for chunk in names.chunks(PER_STATEMENT) {
            let sql = format!(
                "SELECT {COLUMNS} FROM thumbnails WHERE {}",
                self.placeholders(chunk.len())
            );
            for r in bind_named(&sql, run_id, chunk)
                .fetch_all(self.store.pool())
                .await?
            {
                found.push(thumbnail_row(&r)?);
            }
        }
        Ok(found)
    }

    /// Records thumbnails put under the run's prefix, over what was recorded of the same names
    /// (a thumbnail put again replaced the object).
    pub async fn record(&self, run_id: &RunId, thumbnails: &[Thumbnail]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        for chunk in thumbnails.chunks(PER_STATEMENT) {
            let values = rows(self.store.backend(), chunk.len(), 9, |p| {
                format!("({})", p.join(", "))
            });
            let sql = format!(
                "INSERT INTO thumbnails (run_id, {COLUMNS}) VALUES {values}
                 ON CONFLICT (run_id, name) DO UPDATE SET
                   width = excluded.width, height = excluded.height,
                   thumb_width = excluded.thumb_width, thumb_height = excluded.thumb_height,
                   alpha = excluded.alpha, bytes = excluded.bytes, etag = excluded.etag"
            );
            // Built from a fixed placeholder list: no value is ever part of the text.
            let mut query = sqlx::query(sqlx::AssertSqlSafe(sql));
            for t in chunk {
                query = query
                    .bind(run_id)
                    .bind(&t.name)
                    .bind(i64::from(t.size.0))
                    .bind(i64::from(t.size.1))
                    .bind(i64::from(t.thumb_size.0))
                    .bind(i64::from(t.thumb_size.1))
                    .bind(i64::from(t.alpha))
                    .bind(i64::try_from(t.bytes).unwrap_or(i64::MAX))
                    .bind(t.etag.as_deref());
            }
            query.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Forgets thumbnails no longer in the bucket as they were put: the next report makes them
    /// again.
    pub async fn forget(&self, run_id: &RunId, names: &[String]) -> Result<(), StoreError> {
        let mut tx = self.store.pool().begin().await?;
        for chunk in names.chunks(PER_STATEMENT) {
            let sql = format!(
                "DELETE FROM thumbnails WHERE {}",
                self.placeholders(chunk.len())
            );
            bind_named(&sql, run_id, chunk).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The condition on a run's thumbnails of `n` names: the run bound first, then the names.
    fn placeholders(&self, n: usize) -> String {
        let marks = rows(self.store.backend(), n + 1, 1, |p| p[0].clone());
        let (run, names) = marks.split_once(", ").unwrap_or((&marks, ""));
        format!("run_id = {run} AND name IN ({names})")
    }
}

/// `sql` (a fixed text of [`Thumbnails::placeholders`]'s placeholders) with the run and the names bound.
fn bind_named<'q>(
    sql: &str,
    run_id: &'q RunId,
    names: &'q [String],
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments> {
    // Built from a fixed placeholder list: no value is ever part of the text.
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned())).bind(run_id);
    for name in names {
        query = query.bind(name);
    }
    query
}
