//! `outbox demo`: the order → inventory story end to end, with faults injected.

/// Options of `outbox demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Orders to place.
    #[arg(long, default_value_t = 10_000)]
    pub orders: usize,
}

/// Run the demo; an invariant failure is an error (non-zero exit).
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::bail!("demo not implemented yet ({} orders)", args.orders)
}
