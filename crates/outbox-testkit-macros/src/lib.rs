//! `#[suite_test]`: the preamble and teardown every test of the outbox suite
//! (`crates/outbox-testkit/tests/suite`) shares, written once.
//!
//! ```ignore
//! #[suite_test]
//! async fn relay_publishes(fx: PgFixture) {
//!     // … the test, with `fx` a fresh `PgFixture::new().await` …
//! }
//! ```
//!
//! expands to
//!
//! ```ignore
//! #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//! async fn relay_publishes() {
//!     crate::init_tracing();
//!     let fx = <PgFixture>::new().await;
//!     { /* … the test … */ }
//!     fx.cleanup().await;
//! }
//! ```
//!
//! Arguments: `workers = N` sets the runtime's worker threads (default 2). The test takes no
//! argument, or one fixture argument `name: Type` where `Type` has an `async fn new() -> Type`
//! and an `async fn cleanup(&self)` (the testkit's store and broker fixtures); without one, the
//! expansion is the runtime and `crate::init_tracing()` alone. A test that returns early, or
//! panics, skips the cleanup, as a hand-written test would; the fixtures' tables and streams
//! have unique names, so nothing is shared with the next test.

use proc_macro::TokenStream;
use quote::quote;
use syn::parse::Parser;
use syn::{FnArg, ItemFn, Pat};

/// The suite's test attribute; see the crate docs for the expansion. Errors (at compile time):
/// an argument other than `workers = N`, a function that is not `async`, more than one fixture
/// argument, an attribute on the fixture argument, or a return type beside a fixture (an early
/// `?` would skip the cleanup).
#[proc_macro_attribute]
pub fn suite_test(args: TokenStream, item: TokenStream) -> TokenStream {
    match expand(args.into(), item.into()) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(
    args: proc_macro2::TokenStream,
    item: proc_macro2::TokenStream,
) -> syn::Result<proc_macro2::TokenStream> {
    let mut workers = proc_macro2::Literal::usize_unsuffixed(2);
    let parser = syn::meta::parser(|meta| {
        if meta.path.is_ident("workers") {
            let n: usize = meta.value()?.parse::<syn::LitInt>()?.base10_parse()?;
            workers = proc_macro2::Literal::usize_unsuffixed(n);
            Ok(())
        } else {
            Err(meta.error("expected `workers = N`"))
        }
    });
    parser.parse2(args)?;
    let mut f: ItemFn = syn::parse2(item)?;
    if f.sig.asyncness.is_none() {
        return Err(syn::Error::new_spanned(
            &f.sig,
            "a suite test is an `async fn`",
        ));
    }
    let fixture = match f.sig.inputs.len() {
        0 => None,
        1 => match f.sig.inputs.first() {
            Some(FnArg::Typed(arg)) if !arg.attrs.is_empty() => {
                return Err(syn::Error::new_spanned(
                    arg,
                    "a fixture argument takes no attributes",
                ));
            }
            Some(FnArg::Typed(arg)) => match &*arg.pat {
                Pat::Ident(name) => Some((name.clone(), (*arg.ty).clone())),
                other => {
                    return Err(syn::Error::new_spanned(other, "expected `name: Fixture`"));
                }
            },
            Some(other) => return Err(syn::Error::new_spanned(other, "expected `name: Fixture`")),
            None => None,
        },
        _ => {
            return Err(syn::Error::new_spanned(
                &f.sig.inputs,
                "a suite test takes at most one fixture",
            ));
        }
    };
    if fixture.is_some() && !matches!(f.sig.output, syn::ReturnType::Default) {
        // `?` or a returned error would skip the cleanup.
        return Err(syn::Error::new_spanned(
            &f.sig.output,
            "a suite test with a fixture returns `()`: panic instead, so the cleanup is not skipped by `?`",
        ));
    }
    f.sig.inputs.clear();
    let body = &f.block;
    let block = match fixture {
        Some((binding, ty)) => {
            let name = &binding.ident;
            quote! {{
                crate::init_tracing();
                let #binding = <#ty>::new().await;
                #body
                #name.cleanup().await;
            }}
        }
        None => quote! {{
            crate::init_tracing();
            #body
        }},
    };
    f.block = syn::parse2(block)?;
    Ok(quote! {
        #[::tokio::test(flavor = "multi_thread", worker_threads = #workers)]
        #f
    })
}
