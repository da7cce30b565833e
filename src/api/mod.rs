//! Everything about talking to the image service: the wire types and their rules, the HTTP
//! client, the classification of failures by billing, the undocumented records, the one retry
//! policy, and downloads (checked whole before a destination keeps them, and refused URLs
//! refreshed).

pub mod client;
pub mod download;
pub mod error;
pub mod fetch;
pub mod job_id;
pub mod key;
pub mod partial;
pub mod records;
pub mod retry;
pub mod rules;
pub mod types;

pub use client::{Client, ClientConfig};
pub use download::{Destination, Downloader};
pub use error::{ApiError, Billing, ErrorKind};
pub use key::ApiKey;
pub use records::{Account, JobRecord, Models};
pub use retry::RetryPolicy;
pub use types::{
    GenerationJob, GenerationRequest, Size, ToolJob, ToolName, ToolParams, ToolRequest,
};
