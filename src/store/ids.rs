//! Row ids, one type a table: a task's id is never taken for an output's, and no id is 0.
//!
//! The database keeps them as 64-bit integers (`INTEGER PRIMARY KEY`, `BIGINT … IDENTITY`),
//! which both backends count from 1. A row id is made from a number only where a statement
//! reads it ([`sqlx::Decode`], refusing 0) or where the executor counts ids it knows to be
//! consecutive ([`TaskId::offset`]); "no row" is an `Option`, never 0. A list of them kept as
//! JSON (a reroll's tasks) is a list of those numbers.

use std::fmt;
use std::num::NonZeroI64;

macro_rules! row_id {
    ($(#[$doc:meta])* $name:ident, $table:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize,
            serde::Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(NonZeroI64);

        impl $name {
            /// The id the number is; `None` for 0, which no row has.
            pub fn new(id: i64) -> Option<$name> {
                NonZeroI64::new(id).map($name)
            }

            /// The number the database keeps.
            pub fn get(self) -> i64 {
                self.0.get()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        /// Bound as the integer the database keeps.
        impl sqlx::Type<sqlx::Any> for $name {
            fn type_info() -> sqlx::any::AnyTypeInfo {
                <i64 as sqlx::Type<sqlx::Any>>::type_info()
            }

            fn compatible(ty: &sqlx::any::AnyTypeInfo) -> bool {
                <i64 as sqlx::Type<sqlx::Any>>::compatible(ty)
            }
        }

        impl sqlx::Encode<'_, sqlx::Any> for $name {
            fn encode_by_ref(
                &self,
                buf: &mut <sqlx::Any as sqlx::Database>::ArgumentBuffer,
            ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
                <i64 as sqlx::Encode<'_, sqlx::Any>>::encode(self.get(), buf)
            }
        }

        /// A 0 read back is no row of the table: an error, never "none".
        impl<'r> sqlx::Decode<'r, sqlx::Any> for $name {
            fn decode(
                value: <sqlx::Any as sqlx::Database>::ValueRef<'r>,
            ) -> Result<$name, sqlx::error::BoxDynError> {
                let id = <i64 as sqlx::Decode<'r, sqlx::Any>>::decode(value)?;
                $name::new(id).ok_or_else(|| concat!("a row id of 0 in ", $table).into())
            }
        }
    };
}

row_id!(
    /// A task's row (`tasks.id`).
    TaskId,
    "tasks"
);
row_id!(
    /// An HTTP attempt's row (`attempts.id`).
    AttemptId,
    "attempts"
);
row_id!(
    /// A kept output's row (`outputs.id`).
    OutputId,
    "outputs"
);
row_id!(
    /// An output set aside, its file moved away (`superseded_outputs.id`).
    SupersededId,
    "superseded_outputs"
);
row_id!(
    /// A reroll's row (`rerolls.id`).
    RerollId,
    "rerolls"
);
row_id!(
    /// A journaled file move of a resume (`pending_moves.id`).
    MoveId,
    "pending_moves"
);

impl TaskId {
    /// The id `n` rows after this one: a chunk's tasks, recorded in one statement, have
    /// consecutive ids. `None` past the integer's range (or at 0).
    pub fn offset(self, n: i64) -> Option<TaskId> {
        self.get().checked_add(n).and_then(TaskId::new)
    }

    /// This id and those after it, in order: the ids of a chunk recorded in one statement.
    pub fn and_after(self) -> impl Iterator<Item = TaskId> {
        (self.get()..).map_while(TaskId::new)
    }
}

/// A sha256 is bound as the text the database keeps, and read back strictly: text that is not
/// one is an error, never taken for a digest.
impl sqlx::Type<sqlx::Any> for crate::sha256::Sha256Sum {
    fn type_info() -> sqlx::any::AnyTypeInfo {
        <String as sqlx::Type<sqlx::Any>>::type_info()
    }

    fn compatible(ty: &sqlx::any::AnyTypeInfo) -> bool {
        <String as sqlx::Type<sqlx::Any>>::compatible(ty)
    }
}

impl sqlx::Encode<'_, sqlx::Any> for crate::sha256::Sha256Sum {
    fn encode_by_ref(
        &self,
        buf: &mut <sqlx::Any as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <String as sqlx::Encode<'_, sqlx::Any>>::encode(self.as_str().to_owned(), buf)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Any> for crate::sha256::Sha256Sum {
    fn decode(
        value: <sqlx::Any as sqlx::Database>::ValueRef<'r>,
    ) -> Result<crate::sha256::Sha256Sum, sqlx::error::BoxDynError> {
        let text = <String as sqlx::Decode<'r, sqlx::Any>>::decode(value)?;
        Ok(crate::sha256::Sha256Sum::parse(&text)?)
    }
}

/// A job id is bound as the text the database keeps, and read back as it is.
impl sqlx::Type<sqlx::Any> for crate::api::job_id::JobId {
    fn type_info() -> sqlx::any::AnyTypeInfo {
        <String as sqlx::Type<sqlx::Any>>::type_info()
    }

    fn compatible(ty: &sqlx::any::AnyTypeInfo) -> bool {
        <String as sqlx::Type<sqlx::Any>>::compatible(ty)
    }
}

impl sqlx::Encode<'_, sqlx::Any> for crate::api::job_id::JobId {
    fn encode_by_ref(
        &self,
        buf: &mut <sqlx::Any as sqlx::Database>::ArgumentBuffer,
    ) -> Result<sqlx::encode::IsNull, sqlx::error::BoxDynError> {
        <String as sqlx::Encode<'_, sqlx::Any>>::encode(self.as_str().to_owned(), buf)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Any> for crate::api::job_id::JobId {
    fn decode(
        value: <sqlx::Any as sqlx::Database>::ValueRef<'r>,
    ) -> Result<crate::api::job_id::JobId, sqlx::error::BoxDynError> {
        Ok(crate::api::job_id::JobId::new(<String as sqlx::Decode<
            'r,
            sqlx::Any,
        >>::decode(value)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_id_is_zero_and_each_shows_its_number() {
        assert_eq!(TaskId::new(0), None);
        let id = TaskId::new(41).unwrap();
        assert_eq!(id.get(), 41);
        assert_eq!(id.offset(1).map(TaskId::get), Some(42));
        assert_eq!(id.offset(-41), None);
        let next: Vec<i64> = id.and_after().take(2).map(TaskId::get).collect();
        assert_eq!(next, [41, 42]);
        assert_eq!(id.to_string(), "41");
    }

    /// A statement's 0 is no task, and text that is no digest is no sha256: both are errors
    /// where they are read, never "none" nor a digest.
    #[tokio::test]
    async fn a_row_id_of_0_or_a_sha256_that_is_none_is_refused_where_it_is_read() {
        use crate::sha256::Sha256Sum;
        use sqlx::Row;
        sqlx::any::install_default_drivers();
        let pool = sqlx::AnyPool::connect("sqlite::memory:").await.unwrap();
        let sha = Sha256Sum::of_bytes(b"x");
        let row = sqlx::query("SELECT 0 AS zero, 7 AS seven, 'recorded' AS text, $1 AS sha")
            .bind(&sha)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert!(row.try_get::<TaskId, _>("zero").is_err());
        assert_eq!(row.try_get::<TaskId, _>("seven").unwrap().get(), 7);
        assert!(row.try_get::<Sha256Sum, _>("text").is_err());
        assert_eq!(row.try_get::<Sha256Sum, _>("sha").unwrap(), sha);
    }
}
