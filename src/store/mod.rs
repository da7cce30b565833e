//! The state database: every run, task, HTTP attempt and output, in SQLite (the default, a
//! file beside nothing else) or in PostgreSQL (`--state postgres://…`, shared by hosts).
//!
//! Both backends are reached through sqlx's `Any` driver, so the store's queries are written
//! once, in SQL both accept (`$N` parameters, `COUNT(*) FILTER`, 64-bit integers); the few
//! statements that must differ are chosen by [`Backend`] where they are written
//! ([`tasks`]'s hot path). Each backend has its own migrations: `migrations/sqlite/` and
//! `migrations/postgres/`.
//!
//! The executor writes its intent before each billed call and the result right after, each in
//! its own transaction, so whatever instant a crash happens at, the record tells what may have
//! been billed: an attempt without an outcome is a call that was in flight.
//!
//! Schema changes are migrations in `migrations/`, embedded in the binary. A database written
//! by a newer imgpipe, one that is not a database at all, another application's, or an empty
//! file imgpipe did not create, is reported and never touched.
//!
//! The database marks itself as imgpipe's with `PRAGMA application_id` ([`APPLICATION_ID`]).
//! A new one is made whole under a temporary name (marked, every migration applied) and only
//! then linked into place, so a crash while creating it never leaves at its path a file that
//! imgpipe would later refuse as empty or unmarked.

mod attempts;
mod browse;
mod caps;
mod check_figures;
mod gauges;
pub mod group;
mod identities;
mod ids;
mod kept;
pub mod ledger;
mod location;
pub mod lock;
mod outline;
mod outputs;
mod postgres;
mod rates;
mod report;
mod rerolls;
mod revisions;
mod run_figures;
mod runs;
pub(crate) mod tasks;
#[cfg(test)]
pub(crate) mod test_postgres;
mod thumbnails;
mod verdicts;

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::MigrateError;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AnyPool, ConnectOptions, Executor};

pub use attempts::{AttemptOutcome, Attempts, CallOutcome, Settled};
pub use browse::{ItemFilter, ItemPage, PageItem, PageTask};
pub use caps::{CapSetting, CapWindow, Caps, Lessee};
pub use check_figures::{CheckCounts, FlaggedOutput, ShownVerdict};
pub use gauges::{Gauges, RunGauges};
pub use location::{Location, PgUrl};
pub use outline::{ItemOutline, TaskBlock};
pub use rates::{Drawer, Drawn, NewDrawer, Rates};

pub use identities::{Identities, Reusable, ReusableOutput};
pub use ids::{AttemptId, MoveId, OutputId, RerollId, SupersededId, TaskId};
pub use kept::{Kept, StoredOutput};
pub use outputs::{Outputs, RecordedOutput, UrlIssued};
pub use report::{
    EarlierOutput, Report, ReportEntry, ReportOutput, ReportTask, Spend, StepTotals, TaskRequest,
};
pub use rerolls::{NewReroll, OpenReroll, RunBefore, Undone};
pub use revisions::{Blocked, Changes, Checked, PendingMove, Reused, Revisions, SetAside, TaskRef};
pub use run_figures::{AmbiguousAttempt, StepCounts, Totals};
pub use runs::{NewRun, RecordedPlan, Run, RunStatus, RunSummary, Runs};
pub use tasks::{LastAttempt, NewTask, RecordedTask, TaskStatus, Tasks};
pub use thumbnails::{Thumbnail, Thumbnails};
pub use verdicts::{Action, Outcome, PassRate, TaskRerolls, VerdictRow, Verdicts};

/// The directory under the user's state directory that holds the default database.
pub const APP_DIR: &str = "imgpipe";
pub const DEFAULT_FILE: &str = "state.db";
/// The default database of runs on the embedded sandbox (`--sandbox`).
pub const SANDBOX_FILE: &str = "sandbox.db";
/// `PRAGMA application_id` of every imgpipe state database: "imgp" in ASCII.
pub const APPLICATION_ID: i32 = i32::from_be_bytes(*b"imgp");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot create the state directory {}: {source}", path.display())]
    Directory {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is there but is no database imgpipe can use (damaged, cut short, not SQLite).
    #[error("cannot open the state database {}: {reason}", path.display())]
    Open { path: PathBuf, reason: String },
    /// A directory (or another non-file) stands where the database should be.
    #[error("cannot open the state database {}: it is a directory, not a file", path.display())]
    NotAFile { path: PathBuf },
    /// The file could not be opened or created: permissions, a full or failing disk.
    #[error("cannot open the state database {}: {reason}", path.display())]
    Io { path: PathBuf, reason: String },
    /// The PostgreSQL server refused the login: a wrong or missing password, an unknown user.
    #[error("cannot open the state database {}: {reason}", path.display())]
    Login { path: PathBuf, reason: String },
    #[error(
        "the state database {} was written by a newer imgpipe (schema version {version}); it was left untouched",
        path.display()
    )]
    Newer { path: PathBuf, version: i64 },
    /// A SQLite database, but not one of imgpipe's: another application's, or no one's yet.
    #[error(
        "{} is not an imgpipe state database: {reason}; it was left untouched",
        path.display()
    )]
    Foreign { path: PathBuf, reason: String },
    /// An empty file: imgpipe makes its databases itself, whole, so it never made this one.
    #[error(
        "the state database {} is an empty file, which imgpipe did not create; it was left untouched",
        path.display()
    )]
    Empty { path: PathBuf },
    /// A PostgreSQL database without imgpipe's tables, opened by a command that only reads.
    #[error("there is no imgpipe state in {}: it holds no tables yet", location.display())]
    Absent { location: PathBuf },
    #[error("the state database {} cannot be brought up to date: {reason}", path.display())]
    Migrate { path: PathBuf, reason: String },
    #[error("state database: {0}")]
    Query(#[from] sqlx::Error),
    /// The record contradicts itself or the pipeline (a bug, or a database edited by hand).
    #[error("state database: {0}")]
    Inconsistent(String),
    /// A run's plan could not be written as the record keeps it (a bug).
    #[error("state database: cannot record the plan: {0}")]
    Plan(String),
    /// A grouped write could not be committed.
    #[error("state database: cannot write: {0}")]
    Write(String),
}

impl StoreError {
    /// What the user can do about it.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            StoreError::Newer { .. } => {
                Some("upgrade imgpipe, or point --state (or IMGPIPE_STATE) at another database")
            }
            StoreError::Open { .. } | StoreError::Migrate { .. } => Some(
                "if the file is damaged, move it aside and point --state (or IMGPIPE_STATE) at a new path; imgpipe never overwrites it",
            ),
            StoreError::NotAFile { .. } => {
                Some("point --state (or IMGPIPE_STATE) at a file, not a directory")
            }
            StoreError::Foreign { .. } => Some(
                "point --state (or IMGPIPE_STATE) at another path: imgpipe keeps its runs in a database of its own and never writes to another application's",
            ),
            StoreError::Empty { .. } => Some(
                "remove the empty file and imgpipe will create the database there, or point --state (or IMGPIPE_STATE) at a path where there is no file",
            ),
            StoreError::Absent { .. } => Some(
                "runs create imgpipe's tables there; check --state (or IMGPIPE_STATE) names the database the runs used",
            ),
            StoreError::Login { .. } => Some(
                "give the password of the URL's user in PGPASSWORD or ~/.pgpass (a line host:port:database:user:password, mode 0600)",
            ),
            StoreError::Directory { .. } | StoreError::Io { .. } => {
                Some("check the permissions and free space there, or point --state at another path")
            }
            // Most often the database cannot take a write (a full disk, a file system or a
            // server gone read-only, a permission) or cannot be reached.
            StoreError::Query(_) | StoreError::Write(_) => Some(
                "check that the state database can be reached and written (free space, permissions, a file system or server gone read-only), then give the same command again",
            ),
            StoreError::Inconsistent(_) | StoreError::Plan(_) => None,
        }
    }

    /// Whether the file the user named is the problem (exit 2: invalid input), rather than
    /// the machine failing to read or write it (exit 1).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StoreError::Open { .. }
                | StoreError::NotAFile { .. }
                | StoreError::Newer { .. }
                | StoreError::Foreign { .. }
                | StoreError::Empty { .. }
                | StoreError::Absent { .. }
        )
    }
}

/// Which database engine keeps the state: the few statements that differ are chosen by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// An open state database.
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    /// Where a long read streams its rows from: on SQLite a read-only connection of its own,
    /// since a stream holds its connection until it ends and the pool's one connection is
    /// needed meanwhile (a report asks for each page's earlier versions while its rows are
    /// still streaming); on PostgreSQL the pool itself.
    streams: AnyPool,
    backend: Backend,
    location: Location,
    writer: group::Writer,
}

impl Store {
    /// From now on every record of the run's work checks that `fence` still holds the run's
    /// lock (PostgreSQL; see [`group::Fence`]). A later lock's fence replaces it.
    pub fn fence(&self, fence: group::Fence) {
        self.writer.fence(fence);
    }

    /// The fence a lock set, if any: writes outside the group writer check it too.
    pub(crate) fn fenced_by(&self) -> Option<group::Fence> {
        self.writer.fenced_by()
    }

    /// Opens the state at `location`: a SQLite file is created when missing; a PostgreSQL
    /// database must exist, and gets imgpipe's tables when it has none of anyone's.
    pub async fn open_at(location: &Location) -> Result<Store, StoreError> {
        match location {
            Location::File(path) => Store::open(path).await,
            Location::Postgres(url) => postgres::open(url, true).await,
        }
    }

    /// Opens the state at `location` for a command that only reads: nothing is created.
    pub async fn open_existing(location: &Location) -> Result<Store, StoreError> {
        match location {
            Location::File(path) => Store::open(path).await,
            Location::Postgres(url) => postgres::open(url, false).await,
        }
    }

    fn new(pool: AnyPool, backend: Backend, location: Location) -> Store {
        Store::with_streams(pool.clone(), pool, backend, location)
    }

    fn with_streams(
        pool: AnyPool,
        streams: AnyPool,
        backend: Backend,
        location: Location,
    ) -> Store {
        Store {
            writer: group::Writer::start(pool.clone()),
            pool,
            streams,
            backend,
            location,
        }
    }

    /// Opens (creating when missing) and migrates the database at `path`. An existing file
    /// must be an imgpipe database: one from before the mark is marked on the way.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|source| StoreError::Directory {
                path: dir.to_path_buf(),
                source,
            })?;
        }
        let open_err = |e: sqlx::Error| StoreError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        if path.exists() && !path.is_file() {
            return Err(StoreError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        let io_err = |e: std::io::Error| StoreError::Io {
            path: path.to_path_buf(),
            reason: e.to_string(),
        };
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => create(path).await?,
            Err(e) => return Err(io_err(e)),
            Ok(m) if m.len() == 0 => {
                return Err(StoreError::Empty {
                    path: path.to_path_buf(),
                });
            }
            Ok(_) => {}
        }
        let unmarked = inspect(path).await? == Mark::Missing;
        let options = SqliteConnectOptions::from_str("sqlite:")
            .map_err(open_err)?
            .filename(path)
            // Made by `create` (or refused) above: a file gone since is an error, not new.
            .create_if_missing(false);
        let mut options = AnyConnectOptions::from_url(&options.to_url_lossy()).map_err(open_err)?;
        // Statements are the store's business: their text goes to -vv, never to the user's
        // default log, and a slow one is a debug note, not a warning.
        options = options
            .log_statements(log::LevelFilter::Trace)
            .log_slow_statements(log::LevelFilter::Debug, Duration::from_secs(1));
        install_drivers();
        // One connection: every write is serialised anyway, and one connection never waits on
        // another's lock.
        let pool = AnyPoolOptions::new()
            .max_connections(1)
            // A file on this machine does not go stale between uses: no ping round trip to
            // SQLite's thread before every group commit and every read.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    // FULL: a commit is on disk before the paid call it announces is sent.
                    conn.execute(
                        "PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;
                         PRAGMA foreign_keys = ON; PRAGMA busy_timeout = 30000;",
                    )
                    .await
                    .map(drop)
                })
            })
            .connect_with(options.clone())
            .await
            .map_err(open_err)?;
        // Made when first used: in WAL mode a reader neither waits on the writer nor holds it.
        let streams = AnyPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("PRAGMA query_only = ON; PRAGMA busy_timeout = 30000;")
                        .await
                        .map(drop)
                })
            })
            .connect_lazy_with(options);
        let location = Location::File(path.to_path_buf());
        let store = Store::with_streams(pool, streams, Backend::Sqlite, location);
        if unmarked {
            store.mark().await?;
        }
        store.migrate().await?;
        Ok(store)
    }

    /// Marks a database of imgpipe's from before the mark as imgpipe's.
    async fn mark(&self) -> Result<(), StoreError> {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA application_id = {APPLICATION_ID}"
        )))
        .execute(&self.pool)
        .await
        .map(drop)
        .map_err(|e| StoreError::Io {
            path: self.file(),
            reason: format!("cannot mark it as imgpipe's: {e}"),
        })
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        match SQLITE_MIGRATOR.run(&self.pool).await {
            Ok(()) => Ok(()),
            Err(MigrateError::VersionMissing(version)) => Err(StoreError::Newer {
                path: self.file(),
                version,
            }),
            Err(e) => Err(StoreError::Migrate {
                path: self.file(),
                reason: e.to_string(),
            }),
        }
    }

    /// Where the state is, to name it in messages (a PostgreSQL URL without its password).
    pub fn location(&self) -> &Location {
        &self.location
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The SQLite file's path, or the location as text for PostgreSQL (errors name a path).
    fn file(&self) -> PathBuf {
        match &self.location {
            Location::File(path) => path.clone(),
            other => PathBuf::from(other.to_string()),
        }
    }

    pub(crate) fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// The pool a long read streams its rows from ([`Store::streams`]'s field says why).
    pub(crate) fn streams(&self) -> &AnyPool {
        &self.streams
    }

    /// The runs: their records, their plans and what they have done and paid.
    pub fn runs(&self) -> Runs<'_> {
        Runs { store: self }
    }

    /// The runs' tasks, by run.
    pub fn tasks(&self) -> Tasks<'_> {
        Tasks { store: self }
    }

    /// The paid calls the tasks made.
    pub fn attempts(&self) -> Attempts<'_> {
        Attempts { store: self }
    }

    /// The images the calls made, and where they were kept.
    pub fn outputs(&self) -> Outputs<'_> {
        Outputs { store: self }
    }

    /// The spending caps and their leases.
    pub fn caps(&self) -> Caps<'_> {
        Caps { store: self }
    }

    /// The accounts' shared rate limits and the processes drawing from them.
    pub fn rates(&self) -> Rates<'_> {
        Rates { store: self }
    }

    pub async fn close(&self) {
        self.streams.close().await;
        self.pool.close().await;
    }
}

/// The migrations of SQLite state files (`migrations/sqlite/`), embedded once.
static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");

/// sqlx's `Any` driver finds the backend by the URL's scheme among the drivers installed.
pub(crate) fn install_drivers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(sqlx::any::install_default_drivers);
}

/// Makes a new database at `path`, whole: created under a temporary name beside it, marked
/// with [`APPLICATION_ID`], every migration applied, closed and synced, then linked into
/// place unless a file appeared there meanwhile (another imgpipe made it first: that one is
/// used). A crash on the way leaves a hidden `.<name>.<random>.new` beside it, never a file
/// at `path`.
async fn create(path: &Path) -> Result<(), StoreError> {
    let io_err = |e: &dyn std::fmt::Display| StoreError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map_or_else(|| "state.db".into(), |n| n.to_string_lossy());
    let prefix = format!(".{name}.");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix).suffix(".new");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        // What SQLite itself gives a new database (less the umask).
        builder.permissions(std::fs::Permissions::from_mode(0o644));
    }
    let temp = builder.tempfile_in(dir).map_err(|e| io_err(&e))?;
    let options = SqliteConnectOptions::from_str("sqlite:")
        .map_err(|e| io_err(&e))?
        .filename(temp.path())
        // No WAL yet: the file must be whole on its own when it is linked into place.
        .journal_mode(SqliteJournalMode::Delete)
        .synchronous(SqliteSynchronous::Full)
        .log_statements(log::LevelFilter::Trace);
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options)
        .await
        .map_err(|e| io_err(&e))?;
    let made = async {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "PRAGMA application_id = {APPLICATION_ID}"
        )))
        .execute(&mut conn)
        .await
        .map_err(|e| io_err(&e))?;
        SQLITE_MIGRATOR
            .run(&mut conn)
            .await
            .map_err(|e| StoreError::Migrate {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
    }
    .await;
    let closed = sqlx::Connection::close(conn).await;
    made?;
    closed.map_err(|e| io_err(&e))?;
    temp.as_file().sync_all().map_err(|e| io_err(&e))?;
    crate::failpoint::hit("state-created-unlinked");
    match temp.persist_noclobber(path) {
        Ok(_) => {}
        Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
        Err(e) => return Err(io_err(&e.error)),
    }
    // The new name must survive a crash too.
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(&e))?;
    Ok(())
}

/// Whether an existing database carries imgpipe's mark.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    Present,
    /// imgpipe's, from before the mark: its migrations table holds imgpipe's first migration.
    Missing,
}

/// Looks at an existing database read-only before anything writes to it: one written by a
/// newer imgpipe, damaged, or not imgpipe's must be reported exactly as it was found. Opening
/// it for writing would already change it (the journal mode is set in its header).
async fn inspect(path: &Path) -> Result<Mark, StoreError> {
    let damaged = |reason: String| StoreError::Open {
        path: path.to_path_buf(),
        reason,
    };
    // Another application's id in the header is refused before SQLite opens the file: even a
    // read-only connection leaves `-wal` and `-shm` files beside a database in WAL mode.
    if let Some(id) = header_application_id(path)
        && id != 0
        && id != APPLICATION_ID
    {
        return Err(foreign_id(path, id));
    }
    let options = SqliteConnectOptions::from_str("sqlite:")
        .map_err(|e| damaged(e.to_string()))?
        .filename(path)
        .read_only(true)
        .busy_timeout(Duration::from_secs(30));
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    let result = inspect_with(&mut conn, path).await;
    let _ = sqlx::Connection::close(conn).await;
    result
}

async fn inspect_with(conn: &mut sqlx::SqliteConnection, path: &Path) -> Result<Mark, StoreError> {
    let damaged = |reason: String| StoreError::Open {
        path: path.to_path_buf(),
        reason,
    };
    // A file cut inside a page still opens, and quick_check does not see the rows it lost.
    let (page_size,): (i64,) = sqlx::query_as("PRAGMA page_size")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    let len = std::fs::metadata(path).map_or(0, |m| m.len());
    if page_size > 0 && !len.is_multiple_of(page_size.unsigned_abs()) {
        return Err(damaged(format!(
            "it is damaged: its {len} bytes are not a whole number of {page_size}-byte pages, so it was cut short"
        )));
    }
    let (check,): (String,) = sqlx::query_as("PRAGMA quick_check")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    if check != "ok" {
        return Err(damaged(format!("it is damaged ({check})")));
    }
    let mark = whose(conn, path).await?;
    let has_migrations: Option<(String,)> = sqlx::query_as(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(|e| damaged(e.to_string()))?;
    if has_migrations.is_none() {
        return Ok(mark);
    }
    let (latest,): (Option<i64>,) = sqlx::query_as("SELECT MAX(version) FROM _sqlx_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| damaged(e.to_string()))?;
    let known = SQLITE_MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0);
    match latest {
        Some(version) if version > known => Err(StoreError::Newer {
            path: path.to_path_buf(),
            version,
        }),
        _ => Ok(mark),
    }
}

/// The `application_id` in the header of a SQLite file (bytes 68 to 71), when the header
/// is a sound one: a damaged file is SQLite's to describe.
fn header_application_id(path: &Path) -> Option<i32> {
    use std::io::Read;
    let mut header = [0_u8; 100];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .ok()?;
    let page_size = u16::from_be_bytes([header[16], header[17]]);
    let sound = header.starts_with(b"SQLite format 3\0")
        && (page_size == 1 || (page_size >= 512 && page_size.is_power_of_two()))
        && (1..=2).contains(&header[18])
        && (1..=2).contains(&header[19])
        // The payload fractions, fixed by the file format.
        && header[21..24] == [64, 32, 32];
    sound.then(|| i32::from_be_bytes([header[68], header[69], header[70], header[71]]))
}

fn foreign_id(path: &Path, id: i32) -> StoreError {
    StoreError::Foreign {
        path: path.to_path_buf(),
        reason: format!(
            "its application id is {:#010x}, imgpipe's is {APPLICATION_ID:#010x}",
            id.cast_unsigned()
        ),
    }
}

/// Whose database this is: imgpipe's (marked, or from before the mark), or refused as
/// another application's.
async fn whose(conn: &mut sqlx::SqliteConnection, path: &Path) -> Result<Mark, StoreError> {
    let failed = |e: sqlx::Error| StoreError::Open {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let foreign = |reason: String| StoreError::Foreign {
        path: path.to_path_buf(),
        reason,
    };
    let (id,): (i64,) = sqlx::query_as("PRAGMA application_id")
        .fetch_one(&mut *conn)
        .await
        .map_err(failed)?;
    if id == i64::from(APPLICATION_ID) {
        return Ok(Mark::Present);
    }
    if id != 0 {
        return Err(foreign_id(path, i32::try_from(id).unwrap_or_default()));
    }
    let first = SQLITE_MIGRATOR.iter().min_by_key(|m| m.version);
    let has_migrations: Option<(String,)> = sqlx::query_as(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name = '_sqlx_migrations'",
    )
    .fetch_optional(&mut *conn)
    .await
    .map_err(failed)?;
    if let (Some(first), Some(_)) = (first, has_migrations) {
        let applied: Option<(Vec<u8>,)> =
            sqlx::query_as("SELECT checksum FROM _sqlx_migrations WHERE version = $1")
                .bind(first.version)
                .fetch_optional(&mut *conn)
                .await
                .map_err(failed)?;
        if applied.is_some_and(|(sum,)| sum == *first.checksum) {
            return Ok(Mark::Missing);
        }
    }
    let tables: Vec<(String,)> =
        sqlx::query_as("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name LIMIT 6")
            .fetch_all(&mut *conn)
            .await
            .map_err(failed)?;
    let names: Vec<String> = tables.into_iter().map(|(t,)| t).collect();
    Err(foreign(if names.is_empty() {
        "it is a SQLite database without a table, not made by imgpipe".to_owned()
    } else {
        format!(
            "it is another application's SQLite database (tables {})",
            listed(names)
        )
    }))
}

/// The first five of another application's table names (asked for six, to know whether there
/// are more), for the message that refuses its database.
fn listed(mut names: Vec<String>) -> String {
    let more = if names.len() > 5 { ", …" } else { "" };
    names.truncate(5);
    format!("{}{more}", names.join(", "))
}

/// The database path: `--state`/`IMGPIPE_STATE` when given, else `$XDG_STATE_HOME/imgpipe/
/// state.db`, else `~/.local/state/imgpipe/state.db`.
pub fn default_path() -> Option<PathBuf> {
    let non_empty = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let base = non_empty("XDG_STATE_HOME")
        .filter(|p| p.is_absolute())
        .or_else(|| non_empty("HOME").map(|h| h.join(".local").join("state")))?;
    Some(base.join(APP_DIR).join(DEFAULT_FILE))
}

impl Store {
    /// The rows of `query`, a page in the order of an index, read on PostgreSQL with sorts
    /// disabled (`SET LOCAL enable_sort = off`): on a table not analysed yet (right after a
    /// kill, when a takeover arrives) the planner guesses fewer rows than a page and would
    /// rather sort every row of the run for each page than walk the index that gives them in
    /// order (see the `outputs_by_path` migration).
    pub(crate) async fn fetch_unsorted<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>,
    ) -> Result<Vec<sqlx::any::AnyRow>, StoreError> {
        let mut rows = Vec::new();
        self.each_unsorted(query, |r| {
            rows.push(r);
            Ok(())
        })
        .await?;
        Ok(rows)
    }

    /// A transaction that reads before it writes: on SQLite begun `IMMEDIATE`, taking the
    /// write lock first (waiting for it as for any write). Begun deferred, its first write
    /// would upgrade a read of a snapshot another connection has written past since, which
    /// SQLite refuses at once ("database is locked") rather than wait: seen as a cap lease
    /// closed by one run while another's connection wrote.
    pub(crate) async fn begin_write(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Any>, StoreError> {
        Ok(match self.backend() {
            Backend::Sqlite => self.pool().begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.pool().begin().await?,
        })
    }

    /// [`Store::fetch_unsorted`], each row handed to `f` as it comes: a statement that walks
    /// an index in order answers its first rows at once, and they are taken while the
    /// database reads the rest.
    pub(crate) async fn each_unsorted<'q>(
        &self,
        query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments>,
        mut f: impl FnMut(sqlx::any::AnyRow) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        use futures::TryStreamExt;
        match self.backend() {
            Backend::Sqlite => {
                let mut rows = query.fetch(self.pool());
                while let Some(r) = rows.try_next().await? {
                    f(r)?;
                }
            }
            Backend::Postgres => {
                let mut tx = self.pool().begin().await?;
                sqlx::query("SET LOCAL enable_sort = off")
                    .execute(&mut *tx)
                    .await?;
                {
                    let mut rows = query.fetch(&mut *tx);
                    while let Some(r) = rows.try_next().await? {
                        f(r)?;
                    }
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }
}

/// `n` rows of `per_row` placeholders each, in order, laid out by `row` and joined with commas:
/// a statement built this way holds no value in its text. PostgreSQL's are numbered (`$1`,
/// `$2`, …); SQLite's are plain `?`, since SQLite finds a named parameter's index by a linear
/// search, which made a 900-parameter insert spend more time naming parameters than writing.
pub(crate) fn rows(
    backend: Backend,
    n: usize,
    per_row: usize,
    row: impl Fn(&[String]) -> String,
) -> String {
    let mut out = String::new();
    for i in 0..n {
        let marks: Vec<String> = (1..=per_row)
            .map(|j| match backend {
                Backend::Sqlite => "?".to_owned(),
                Backend::Postgres => format!("${}", i * per_row + j),
            })
            .collect();
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&row(&marks));
    }
    out
}

/// A count as the database keeps it: 64-bit signed, the largest it holds when it is larger.
pub(crate) fn to_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A count read back from the database: never negative.
pub(crate) fn to_u64(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// Unix milliseconds, the database's time unit.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_database_from_a_newer_schema_is_refused_and_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let store = Store::open(&path).await.unwrap();
        sqlx::query(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
             VALUES (99991231000000, 'from the future', 1, x'00', 0)",
        )
        .execute(store.pool())
        .await
        .unwrap();
        store.close().await;
        let before = std::fs::read(&path).unwrap();
        let err = Store::open(&path).await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::Newer {
                    version: 99991231000000,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }

    #[tokio::test]
    async fn a_file_that_is_not_a_database_is_reported_and_not_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.db");
        let junk = b"this is not sqlite, it is a shopping list".repeat(200);
        std::fs::write(&path, &junk).unwrap();
        let err = Store::open(&path).await.unwrap_err();
        assert!(err.hint().is_some(), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), junk);
    }
}
