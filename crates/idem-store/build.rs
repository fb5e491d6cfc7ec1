//! Rebuilds the crate when a migration is added or changed: `sqlx::migrate!` embeds
//! `migrations/` at compile time, and Cargo does not otherwise watch that directory (a new
//! migration file would be left out of an incremental build). As `sqlx migrate
//! build-script` writes it.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
