//! The connection a RabbitMQ transport, confirmation sender and consumer share: [`Link`], a lazily
//! (re)connected connection with a pool of confirm-mode channels, and publishing through it.

use super::*;

/// One AMQP message to publish: where, the body and its properties (built by the caller).
pub(crate) struct Publication<'a> {
    pub destination: &'a str,
    pub payload: &'a [u8],
    pub properties: BasicProperties,
}

/// One connection and its idle confirm-mode channels.
pub(crate) struct Session {
    pub(crate) conn: Connection,
    idle: Mutex<Vec<Channel>>,
}

/// Idle channels kept per connection; more are closed when handed back.
const MAX_IDLE_CHANNELS: usize = 32;

/// A lazily (re)connected RabbitMQ connection with a pool of confirm-mode channels and a cache of
/// checked exchanges. Shared by the transport, the confirmation sender and the consumer runner.
pub(crate) struct Link {
    config: RabbitMqConfig,
    /// The node URIs of `config.url` (one, or a seed list).
    uris: Vec<AMQPUri>,
    /// Index in `uris` of the node tried first: the one that answered last.
    preferred: std::sync::atomic::AtomicUsize,
    current: tokio::sync::Mutex<Option<Arc<Session>>>,
    exchanges: Mutex<HashMap<String, Instant>>,
}

impl Link {
    /// A link for `config`, not connected yet.
    pub(crate) fn new(config: RabbitMqConfig) -> Result<Link, ConfigError> {
        config.validate()?;
        let config = config.resolve_secrets()?;
        let uris = config.uris()?;
        Ok(Link {
            config,
            uris,
            preferred: std::sync::atomic::AtomicUsize::new(0),
            current: tokio::sync::Mutex::new(None),
            exchanges: Mutex::new(HashMap::new()),
        })
    }

    pub(crate) fn config(&self) -> &RabbitMqConfig {
        &self.config
    }

    /// Where this link connects, without the password.
    pub(crate) fn describe(&self) -> String {
        redact(&self.config.url)
    }

    /// Open a new connection: to the node that answered last, else to each other node of the
    /// seed list in turn, each within `connect_timeout`.
    ///
    /// # Errors
    /// `Unavailable`, with the reason of every node tried.
    pub(crate) async fn open_connection(&self) -> Result<Connection, TransportError> {
        use std::sync::atomic::Ordering;
        let first = self.preferred.load(Ordering::Relaxed);
        let mut reasons = Vec::new();
        let mut last = None;
        for i in (0..self.uris.len()).map(|k| (first + k) % self.uris.len()) {
            match self.open_one(&self.uris[i]).await {
                Ok(c) => {
                    if i != first {
                        tracing::info!(
                            node = %self.describe_node(i),
                            "RabbitMQ: connected to another node of the seed list"
                        );
                    }
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(c);
                }
                Err(e) => {
                    reasons.push(e.to_string());
                    last = Some(e);
                }
            }
        }
        match (last, reasons.len()) {
            (Some(e), 1) => Err(e),
            _ => Err(TransportError::unavailable(format!(
                "no RabbitMQ node of the seed list answered: {}",
                reasons.join("; ")
            ))),
        }
    }

    /// The URL of node `i` of the seed list, without its password.
    fn describe_node(&self, i: usize) -> String {
        let urls: Vec<&str> = self.config.url.split(',').map(str::trim).collect();
        redact(urls.get(i).copied().unwrap_or(&self.config.url))
    }

    /// Open a connection to one node.
    async fn open_one(&self, uri: &AMQPUri) -> Result<Connection, TransportError> {
        let runtime = lapin::runtime::default_runtime().map_err(|e| {
            TransportError::unavailable("no async runtime for the RabbitMQ client").with_source(e)
        })?;
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain: self.config.tls_ca_pem.clone(),
        };
        let props = ConnectionProperties::default()
            .with_connection_name(self.config.connection_name.clone().into());
        let connect = Connection::connect_uri_with_config(uri.clone(), props, tls, runtime);
        let node = format!("{}:{}", uri.authority.host, uri.authority.port);
        match tokio::time::timeout(self.config.connect_timeout, connect).await {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err(TransportError::unavailable(format!(
                "cannot connect to RabbitMQ at {node}: {e}"
            ))
            .with_source(e)),
            Err(_) => Err(TransportError::unavailable(format!(
                "RabbitMQ at {node} did not complete the connection within {:?}",
                self.config.connect_timeout
            ))),
        }
    }

    /// The current session, connecting when there is none or it is no longer connected.
    pub(crate) async fn session(&self) -> Result<Arc<Session>, TransportError> {
        let mut current = self.current.lock().await;
        if let Some(s) = current.as_ref()
            && s.conn.status().connected()
        {
            return Ok(s.clone());
        }
        if let Some(old) = current.take() {
            tracing::warn!(url = %self.describe(), "RabbitMQ connection lost; reconnecting");
            drop(old);
        }
        let conn = self.open_connection().await?;
        let s = Arc::new(Session {
            conn,
            idle: Mutex::new(Vec::new()),
        });
        *current = Some(s.clone());
        Ok(s)
    }

    /// An idle confirm-mode channel of `s`, or a new one.
    async fn channel(&self, s: &Session) -> Result<Channel, lapin::Error> {
        loop {
            let idle = s.idle.lock().expect("poisoned").pop();
            match idle {
                Some(ch) if ch.status().connected() => return Ok(ch),
                Some(_) => continue,
                None => break,
            }
        }
        let ch = s.conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(ch)
    }

    /// Hand a channel back to the pool when it is still open.
    fn give_back(&self, s: &Session, ch: Channel) {
        if !ch.status().connected() {
            return;
        }
        let mut idle = s.idle.lock().expect("poisoned");
        if idle.len() < MAX_IDLE_CHANNELS {
            idle.push(ch);
        }
    }

    /// Check that the broker answers: connect if needed and open and close a channel (one round
    /// trip, no permission needed), within `connect_timeout`.
    pub(crate) async fn probe(&self) -> Result<(), TransportError> {
        let check = async {
            let s = self.session().await?;
            if s.conn.status().blocked() {
                return Err(TransportError::unavailable(
                    "RabbitMQ blocked the connection (memory or disk alarm)",
                ));
            }
            let ch = s.conn.create_channel().await.map_err(|e| {
                TransportError::unavailable("RabbitMQ did not open a channel").with_source(e)
            })?;
            ch.close(200, "probe".into()).await.map_err(|e| {
                TransportError::unavailable("RabbitMQ did not close a channel").with_source(e)
            })
        };
        match tokio::time::timeout(self.config.connect_timeout, check).await {
            Ok(r) => r,
            Err(_) => Err(TransportError::unavailable(format!(
                "RabbitMQ at {} did not answer within {:?}",
                self.describe(),
                self.config.connect_timeout
            ))),
        }
    }

    fn forget_exchanges(&self) {
        self.exchanges.lock().expect("poisoned").clear();
    }

    /// Check the exchanges of `dests` that were not checked within `exchange_check_ttl`, each
    /// with a passive declare. Returns the error of each exchange that failed.
    async fn check_exchanges(
        &self,
        s: &Session,
        dests: &[&Destination],
    ) -> Result<HashMap<String, TransportError>, TransportError> {
        let ttl = self.config.exchange_check_ttl;
        let mut to_check: Vec<&str> = Vec::new();
        {
            let cache = self.exchanges.lock().expect("poisoned");
            for d in dests {
                let fresh = cache.get(&d.exchange).is_some_and(|at| at.elapsed() < ttl);
                if !d.exchange.is_empty() && !fresh && !to_check.contains(&d.exchange.as_str()) {
                    to_check.push(&d.exchange);
                }
            }
        }
        let mut failed = HashMap::new();
        for name in to_check {
            let ch = self.channel(s).await.map_err(|e| {
                TransportError::new(
                    classify(&e, s.conn.status().connected()),
                    "cannot open a RabbitMQ channel",
                )
                .with_source(e)
            })?;
            let declare = ch.exchange_declare(
                ShortString::from(name),
                lapin::ExchangeKind::Direct,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            );
            let r = tokio::time::timeout(self.config.confirm_timeout, declare).await;
            match r {
                Ok(Ok(())) => {
                    self.exchanges
                        .lock()
                        .expect("poisoned")
                        .insert(name.to_owned(), Instant::now());
                    self.give_back(s, ch);
                }
                Ok(Err(e)) => {
                    let connected = s.conn.status().connected();
                    if connection_lost(&e) || !connected {
                        return Err(TransportError::unavailable(
                            "RabbitMQ connection lost while checking exchanges",
                        )
                        .with_source(e));
                    }
                    let reason = match soft_error(&e) {
                        Some((AMQPSoftError::NOTFOUND, text)) => {
                            format!("RabbitMQ exchange {name:?} does not exist: 404 {text}")
                        }
                        Some((code, text)) => format!(
                            "RabbitMQ refused exchange {name:?}: {} {text}",
                            code.get_id()
                        ),
                        None => format!("checking RabbitMQ exchange {name:?} failed: {e}"),
                    };
                    failed.insert(name.to_owned(), error_for(&e, connected, reason));
                }
                Err(_) => {
                    failed.insert(
                        name.to_owned(),
                        TransportError::retryable(format!(
                            "RabbitMQ did not answer the check of exchange {name:?} within {:?}",
                            self.config.confirm_timeout
                        )),
                    );
                }
            }
        }
        Ok(failed)
    }

    /// Publish the batch, pipelined; one result per publication, in order (see the module docs).
    pub(crate) async fn publish(
        &self,
        pubs: &[Publication<'_>],
    ) -> Vec<Result<(), TransportError>> {
        self.publish_observed(pubs, &|_| {}).await
    }

    /// As `publish`, calling `on_ack(i)` as soon as publication `i` is confirmed by the broker
    /// (so the relay keeps it SENT even if its publish timeout cuts the batch short).
    pub(crate) async fn publish_observed(
        &self,
        pubs: &[Publication<'_>],
        on_ack: &(dyn Fn(usize) + Send + Sync),
    ) -> Vec<Result<(), TransportError>> {
        if pubs.is_empty() {
            return Vec::new();
        }
        let mut results: Vec<Option<Result<(), TransportError>>> =
            (0..pubs.len()).map(|_| None).collect();
        let mut dests: Vec<Option<Destination>> = Vec::with_capacity(pubs.len());
        for (i, p) in pubs.iter().enumerate() {
            match Destination::parse(p.destination) {
                Ok(d) => dests.push(Some(d)),
                Err(reason) => {
                    results[i] = Some(Err(TransportError::permanent(reason)));
                    dests.push(None);
                }
            }
            if p.payload.len() > self.config.max_message_bytes {
                results[i] = Some(Err(TransportError::permanent(format!(
                    "payload of {} bytes exceeds the RabbitMQ max_message_bytes of {} bytes",
                    p.payload.len(),
                    self.config.max_message_bytes
                ))));
            }
        }
        let s = match self.session().await {
            Ok(s) => s,
            Err(e) => return fill(results, |_| clone_err(&e)),
        };
        let frame_max = s.conn.configuration().frame_max() as usize;
        for (i, p) in pubs.iter().enumerate() {
            let size = properties_size(&p.properties);
            // An empty frame weighs 8 bytes; the content header adds 14 before the properties.
            if results[i].is_none() && frame_max > 0 && size + 8 + 14 > frame_max {
                results[i] = Some(Err(TransportError::permanent(format!(
                    "AMQP properties and headers of about {size} bytes do not fit in one frame \
                     (frame_max {frame_max} bytes)"
                ))));
            }
        }
        let todo: Vec<usize> = (0..pubs.len()).filter(|i| results[*i].is_none()).collect();
        let checked: Vec<&Destination> = todo.iter().filter_map(|i| dests[*i].as_ref()).collect();
        match self.check_exchanges(&s, &checked).await {
            Ok(failed) => {
                for i in &todo {
                    let d = dests[*i].as_ref().expect("parsed");
                    if let Some(e) = failed.get(&d.exchange) {
                        results[*i] = Some(Err(clone_err(e)));
                    }
                }
            }
            Err(e) => return fill(results, |_| clone_err(&e)),
        }
        let todo: Vec<usize> = todo.into_iter().filter(|i| results[*i].is_none()).collect();
        let closed = self
            .publish_window(&s, pubs, &dests, &todo, &mut results, on_ack)
            .await;
        if !closed.is_empty() {
            // A channel closed by the broker took these down: give each its own result.
            self.forget_exchanges();
            // Closed again on its own, a message's error is its own (recorded by the window).
            for i in closed {
                self.publish_window(&s, pubs, &dests, &[i], &mut results, on_ack)
                    .await;
            }
        }
        fill(results, |_| {
            TransportError::retryable("RabbitMQ publish produced no result")
        })
    }

    /// Publish `todo` on one channel, then await their confirms; record each result, except for
    /// the messages whose channel the broker closed: those are returned (and their result set to
    /// the channel's error, to be replaced if they are published again).
    async fn publish_window(
        &self,
        s: &Session,
        pubs: &[Publication<'_>],
        dests: &[Option<Destination>],
        todo: &[usize],
        results: &mut [Option<Result<(), TransportError>>],
        on_ack: &(dyn Fn(usize) + Send + Sync),
    ) -> Vec<usize> {
        if todo.is_empty() {
            return Vec::new();
        }
        let ch = match self.channel(s).await {
            Ok(ch) => ch,
            Err(e) => {
                let kind = classify(&e, s.conn.status().connected());
                for i in todo {
                    results[*i] = Some(Err(TransportError::new(
                        kind,
                        format!("cannot open a RabbitMQ channel: {e}"),
                    )));
                }
                return Vec::new();
            }
        };
        let deadline = tokio::time::Instant::now() + self.config.confirm_timeout;
        let mut pending = Vec::with_capacity(todo.len());
        let mut closed = Vec::new();
        let mut nacked = false;
        for i in todo {
            let p = &pubs[*i];
            let d = dests[*i].as_ref().expect("parsed");
            let publish = ch.basic_publish(
                d.exchange.as_str().into(),
                d.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                p.payload,
                p.properties.clone(),
            );
            match tokio::time::timeout_at(deadline, publish).await {
                Ok(Ok(confirm)) => pending.push((*i, confirm)),
                Ok(Err(e)) => {
                    self.record_error(s, d, &e, *i, results, &mut closed);
                }
                Err(_) => {
                    results[*i] = Some(Err(timed_out(
                        s,
                        format!(
                            "RabbitMQ publish to {d} could not be written within {:?}",
                            self.config.confirm_timeout
                        ),
                    )));
                }
            }
        }
        for (i, confirm) in pending {
            let d = dests[i].as_ref().expect("parsed");
            results[i] = Some(match tokio::time::timeout_at(deadline, confirm).await {
                Ok(Ok(Confirmation::Ack(None))) => {
                    on_ack(i);
                    Ok(())
                }
                Ok(Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret)))) => {
                    let kind = match self.config.unroutable {
                        Unroutable::Retry => TransportErrorKind::Retryable,
                        Unroutable::Fail => TransportErrorKind::Permanent,
                    };
                    Err(TransportError::new(
                        kind,
                        format!(
                            "RabbitMQ returned the message as unroutable: {} {} ({d}): no queue \
                             is bound for this routing key",
                            ret.reply_code, ret.reply_text
                        ),
                    ))
                }
                Ok(Ok(Confirmation::Nack(None))) => Err({
                    nacked = true;
                    TransportError::destination_busy(format!(
                        "RabbitMQ nacked the message ({d}): a queue it routes to cannot take \
                         messages now (a quorum queue without a leader, a full queue with \
                         x-overflow=reject-publish)"
                    ))
                }),
                Ok(Ok(Confirmation::NotRequested)) => Err(TransportError::retryable(
                    "the RabbitMQ channel is not in confirm mode",
                )),
                Ok(Err(e)) => {
                    self.record_error(s, d, &e, i, results, &mut closed);
                    continue;
                }
                Err(_) => Err(timed_out(
                    s,
                    format!(
                        "no publisher confirm from RabbitMQ within {:?} ({d})",
                        self.config.confirm_timeout
                    ),
                )),
            });
        }
        if nacked {
            // Not reused: a channel whose first publishes to a quorum queue were nacked while
            // the queue elected a leader went on nacking every publish after the election (seen
            // here for over 90 s, RabbitMQ 3.10), while a new channel finds the new leader.
            tokio::spawn(async move {
                let _ = ch.close(200, "nacked".into()).await;
            });
        } else {
            self.give_back(s, ch);
        }
        closed
    }

    /// Record the error of publication `i`; a channel closed by the broker while the connection is
    /// up is noted in `closed` (its cause may be another message).
    fn record_error(
        &self,
        s: &Session,
        d: &Destination,
        e: &lapin::Error,
        i: usize,
        results: &mut [Option<Result<(), TransportError>>],
        closed: &mut Vec<usize>,
    ) {
        let connected = s.conn.status().connected();
        // A 403 (no write permission) is the transport's fault, not one message's: the messages
        // it took down keep that error (Unavailable) instead of being tried one by one.
        let refused = matches!(soft_error(e), Some((AMQPSoftError::ACCESSREFUSED, _)));
        let by_broker = connected
            && !refused
            && (soft_error(e).is_some() || matches!(e.kind(), ErrorKind::InvalidChannelState(..)));
        let reason = match soft_error(e) {
            Some((code, text)) => format!(
                "RabbitMQ closed the channel publishing to {d}: {} {text}",
                code.get_id()
            ),
            None if !connected || connection_lost(e) => {
                format!("RabbitMQ connection lost before the publisher confirm ({d}): {e}")
            }
            None => format!("RabbitMQ publish failed ({d}): {e}"),
        };
        results[i] = Some(Err(error_for(e, connected, reason)));
        if by_broker {
            closed.push(i);
        }
    }
}

/// A timeout: `Unavailable` while the broker blocks the connection (a memory or disk alarm stops
/// publishers until it clears, <https://www.rabbitmq.com/docs/connection-blocked>), otherwise
/// `Retryable`.
pub(super) fn timed_out(s: &Session, reason: String) -> TransportError {
    if s.conn.status().blocked() {
        TransportError::unavailable(format!(
            "{reason}: RabbitMQ blocked the connection (resource alarm)"
        ))
    } else {
        TransportError::retryable(reason)
    }
}

pub(super) fn clone_err(e: &TransportError) -> TransportError {
    if e.is_missing_destination() {
        TransportError::missing_destination(e.report())
    } else {
        TransportError::new(e.kind(), e.report())
    }
}

pub(super) fn fill(
    results: Vec<Option<Result<(), TransportError>>>,
    missing: impl Fn(usize) -> TransportError,
) -> Vec<Result<(), TransportError>> {
    results
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| Err(missing(i))))
        .collect()
}
