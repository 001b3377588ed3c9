/*
 * leases.pml: the bucket-lease protocol of the outbox relay, checked with Spin.
 *
 * docs/lease-model.md maps every step below to the code (file and function), states the
 * properties and the abstractions, and records the measured state spaces; model/check.sh runs
 * every check.
 *
 *   processes  Env          the database clock, crashes and restarts, check-back
 *              Member(r)    relay::membership::membership_loop of relay slot r
 *              Batcher(r)   the read / publish / complete path (relay::run, relay::batch)
 *              Each process is a loop of guarded atomic steps over explicit state, so a crash
 *              (Env) resets a relay in one step, wherever it was.
 *   database   own rem hof  <table>_buckets: owner, expires_at - now() in ticks, handoff
 *              hb           <table>_relays: heartbeat_at + lease - now() (liveness runs)
 *              st att lk    outbox rows: status, attempts, row lock of an open transaction
 *   tokens     a token is only ever compared for equality with the bucket row's token, and
 *              every acquisition draws a fresh one (store::new_token), so a relay's copy of a
 *              token is recorded as current (2) or superseded (1): an acquisition, release or
 *              hand-off of a bucket supersedes every copy of its token (end_epoch).
 *   batches    one row per batch (every property is about one row and its bucket).
 *
 * Switches (spin -a -DX):
 *   NB=1         one bucket: the relay's acquire / give-back decisions for it are free choices
 *                (they depend on the other 63 buckets and the live relays); NB=2: two buckets
 *                and the fair share (safety: any of its values; LIVE: from the heartbeats).
 *   FENCE=2      the code as written (default): the completion share-locks the bucket row it
 *                checks until it commits (PostgreSQL: the fence CTE's FOR SHARE; MySQL/MariaDB:
 *                the multi-table UPDATE's read of the bucket row).
 *   FENCE=1      PostgreSQL before the fix of finding D1: one UPDATE ... FROM UNNEST(...) JOIN
 *                <table>_buckets in a transaction; the bucket row is read, not locked.
 *   P2_SNAPSHOT  check property 2 only as FENCE=1 guarantees it (at the UPDATE), not at COMMIT.
 *   P2_OTHER_OWNER  check at COMMIT only that no other relay holds the current lease with the
 *                row in its batch (the harmful case of finding D1).
 *   LIVE         liveness: ltl `live`, CHAOS faults, then timely relays; run with weak fairness.
 *   CHECK_BACK   Store::check_back moves SENT rows back to PENDING (max_check_backs MAXCB),
 *                attempts reset to 0 (a new round of attempts);
 *   CB_KEEP      check-back before the fix of finding D2: attempts kept;
 *   CB_BOUND     with it, check attempts <= MAXATT + 1 + MAXCB instead of MAXATT + 1.
 *   MONO         also check that no completion lowers a row's attempts (no lost update).
 *   TAKE_GAP     read_buckets and take_batch are separate steps (finding D3); take_batch drops
 *                a row whose bucket is no longer held with the token of the read;
 *   TAKE_NOW     take_batch before the fix of D3: it takes the token held at take time.
 *   ZOMBIE       a fault: a relay cut off from the database between UPDATE and COMMIT; its
 *                session and locks stay (finding D4); IDLE_TIMEOUT: the server ends it.
 *   CLAIM_EXCLUSIVE_PUBLISH  assert what the code does not promise: publishing only under a
 *                valid lease (must fail).
 *   NO_HANDOFF NO_LOST_ANSWER NO_DB_ERRORS NO_UNAVAILABLE NO_STALE_SKIP: leave a fault out.
 *   mutants, each must break one property:
 *   BUG_NO_TOKEN          completion checks owner and expiry, not the token    (property 2)
 *   BUG_NO_EXPIRY         acquire takes buckets whose lease has not expired     (property 1)
 *   BUG_PRECOUNT_UNCAPPED takeover pre-count without the max_attempts check     (property 3)
 *   BUG_NO_TAKEOVER       acquire takes free buckets only, never expired ones   (property 4)
 */

/* ------------------------------------------------------------------ bounds */
#ifndef NR
#define NR 2            /* relay slots: 2 or 3 */
#endif
#ifndef NB
#define NB 2            /* buckets: 1 or 2 */
#endif
#ifndef NM
#define NM 2            /* messages, 1 to 3: m0 and m2 in bucket 0, m1 in bucket NB - 1 */
#endif
#ifndef MAXATT
#define MAXATT 1        /* max_attempts */
#endif
#ifndef LEASE
#define LEASE 2         /* lease length in ticks of the database clock */
#endif
#ifndef MAXCB
#define MAXCB 1         /* max_check_backs */
#endif
#ifndef FENCE
#define FENCE 2
#endif
#ifndef CHAOS
#define CHAOS 2         /* liveness: faults before the relays are timely */
#endif
#define GHOST (NR + 1)  /* a relay name no slot runs: a peer that has gone */

#define BK(m) ((m) % NB)

#ifdef CB_BOUND
#define ATTBOUND (MAXATT + 1 + MAXCB)
#else
#define ATTBOUND (MAXATT + 1)
#endif
#ifdef NO_DB_ERRORS
#define DB_ERRORS false
#else
#define DB_ERRORS true
#endif
#ifdef NO_UNAVAILABLE
#define UNAVAILABLE false
#else
#define UNAVAILABLE true
#endif
#ifdef NO_STALE_SKIP
#define STALE_SKIP false
#else
#define STALE_SKIP true
#endif
#ifdef NO_HANDOFF
#define HANDOFF false
#else
#define HANDOFF true
#endif

/* message status */
#define PENDING 1
#define SENT    2
#define FAILED  3
/* outcome of the batch row (store::Outcome) */
#define O_NONE    0
#define O_SENT    1
#define O_RETRY   2
#define O_FAILED  3
#define O_RELEASE 4
/* release / hand-off statement to run, with the token it carries current or superseded */
#define REL_OLD 1
#define REL_CUR 2
#define HOF_OLD 3
#define HOF_CUR 4
/* batch phases */
#define IDLE    0       /* no batch */
#define READ    1       /* read_buckets returned the row, take_batch not run yet */
#define READY   2       /* in flight: the next statement (pre-count, or publish + completion) */
#define OPEN    3       /* its UPDATE ran, COMMIT not yet */

/* ------------------------------------------------------------------ the database */
byte own[NB];           /* owner: relay name (slot + 1), 0 = NULL */
byte rem[NB];           /* expires_at - now() in ticks, 0 = expired or '-infinity' */
byte hof[NB];           /* handoff: relay name, 0 = NULL */
#ifdef LIVE
byte hb[NR];            /* heartbeat_at + lease - now() per relay */
#endif
byte st[NM];            /* status */
byte att[NM];           /* attempts */
byte lk[NM];            /* row lock of an open transaction of slot lk - 1 */
#ifdef CHECK_BACK
byte cb[NM];            /* check_backs */
#endif
#if FENCE == 2
byte sl[NB];            /* share locks on bucket rows, a bit per slot */
#endif

/* ------------------------------------------------------------------ relay slots */
byte nm[NR];            /* name the slot runs as (r + 1); 0 = down */
byte hl[NR * NB];       /* Ownership::held: 0 no, 1 superseded token, 2 current token */
bit  su[NR * NB];       /* Held::suspect: taken over, not read since */
bit  hom[NR * NB];      /* Inner::handoffs: marked by route_elsewhere */
byte po[NR * NB];       /* release / hand-off statement to run */
byte ph[NR];            /* batch phase */
byte br[NR];            /* the batch's row */
byte bt[NR];            /* Work::token: 1 superseded, 2 current */
byte bs[NR];            /* Work::stored_attempts: as read, + 1 once pre-counted */
byte bo[NR];            /* Work::outcome */
bit  bk[NR];            /* Work::counted: a takeover batch */
byte rt[NR];            /* the token the bucket was held with when the read started */
bit  ck[NR];            /* the next / open statement is the takeover pre-count */

#ifdef LIVE
byte chaos = CHAOS;
#define CHAOS_OK (chaos > 0)
#define SPEND chaos--
#else
#define CHAOS_OK true
#define SPEND skip
#endif

#define HL(r,b)  hl[(r)*NB + (b)]
#define SU(r,b)  su[(r)*NB + (b)]
#define HOM(r,b) hom[(r)*NB + (b)]
#define PO(r,b)  po[(r)*NB + (b)]
#define BUCKET(r) BK(br[r])
#define INFLIGHT(r,b) (ph[r] >= READY && BUCKET(r) == (b))
#define LOCKED(r) (ph[r] == OPEN && lk[br[r]] == (r) + 1)
/* Work::attempt: the number of this publish */
#define ATTEMPT(r) (bk[r] -> bs[r] : bs[r] + 1)

hidden byte i, j, k, n, x;

/* ------------------------------------------------------------------ tokens */
inline end_epoch(b) {
  for (i : 0 .. NR - 1) {
    if :: HL(i, b) == 2 -> HL(i, b) = 1 :: else fi;
    if :: ph[i] >= READY && bt[i] == 2 && BK(br[i]) == b -> bt[i] = 1 :: else fi;
    if :: ph[i] == READ && rt[i] == 2 && BK(br[i]) == b -> rt[i] = 1 :: else fi;
    if
    :: PO(i, b) == REL_CUR -> PO(i, b) = REL_OLD
    :: PO(i, b) == HOF_CUR -> PO(i, b) = HOF_OLD
    :: else
    fi
  };
  skip
}

inline clear_batch(r) {
  ph[r] = IDLE; br[r] = 0; bt[r] = 0; bs[r] = 0; bo[r] = O_NONE; bk[r] = 0; ck[r] = 0; rt[r] = 0
}

/* ------------------------------------------------------------------ membership */
/* acquire: WHERE expires_at < now() OR (owner IS NULL AND handoff IS NULL) ... SKIP LOCKED */
#if defined(BUG_NO_EXPIRY)
#define ACQUIRABLE(b) (own[b] != nm[r] && (own[b] != 0 || hof[b] == 0 || rem[b] == 0))
#elif defined(BUG_NO_TAKEOVER)
#define ACQUIRABLE(b) (own[b] == 0 && (hof[b] == 0 || rem[b] == 0))
#else
#define ACQUIRABLE(b) (rem[b] == 0 || (own[b] == 0 && hof[b] == 0))
#endif
#if FENCE == 2
#define UNLOCKED(b) (sl[b] == 0)
#else
#define UNLOCKED(b) true
#endif

/* One PgStore::membership transaction with fair share SHARE, then Ownership::apply_round and
 * the local part of membership::hand_off when the answer arrives (LOCAL = 1); LOCAL = 0: the
 * transaction committed but its answer was lost (nothing changes locally). */
inline round(r, LOCAL, SHARE) {
  x = 0;                                               /* renewed + handed over */
  for (j : 0 .. NB - 1) {                              /* renew: owner, token, expires_at > now() */
    if
    :: HL(r, j) == 2 && rem[j] > 0 ->
       assert(own[j] == nm[r]);
       rem[j] = LEASE; x++
    :: HL(r, j) != 0 && !(HL(r, j) == 2 && rem[j] > 0) ->
       if :: LOCAL -> HL(r, j) = 0; SU(r, j) = 0; printf("R%d: bucket %d lost (not renewed)\n", r, j) :: else fi
    :: else
    fi
  };
  if
  :: HANDOFF ->
     for (j : 0 .. NB - 1) {                           /* take_handoffs: owner NULL, handoff = relay */
       if
       :: own[j] == 0 && hof[j] == nm[r] ->
          end_epoch(j); own[j] = nm[r]; rem[j] = LEASE; hof[j] = 0; x++;
          printf("R%d: takes bucket %d handed over to it (answer lost: %d)\n", r, j, 1 - LOCAL);
          if :: LOCAL -> HL(r, j) = 2; SU(r, j) = 0 :: else fi
       :: else
       fi
     }
  :: else
  fi;
  if :: SHARE > x -> x = SHARE - x :: else -> x = 0 fi; /* need */
  for (j : 0 .. NB - 1) {                              /* acquire: ORDER BY bucket LIMIT need */
    if
    :: x > 0 && ACQUIRABLE(j) && UNLOCKED(j) ->
       assert(own[j] == 0 || rem[j] == 0);             /* property 1 */
       k = (own[j] != 0);                              /* was_owned: a takeover */
       end_epoch(j); own[j] = nm[r]; rem[j] = LEASE; hof[j] = 0; x--;
       printf("R%d: acquires bucket %d with a new token (takeover: %d, answer lost: %d)\n", r, j, k, 1 - LOCAL);
       if :: LOCAL -> HL(r, j) = 2; SU(r, j) = k :: else fi
    :: else
    fi
  };
  if
  :: LOCAL ->
     n = 0;                                            /* above the share: give back the */
     for (j : 0 .. NB - 1) { if :: HL(r, j) != 0 -> n++ :: else fi };   /* highest idle ones */
     for (j : 0 .. NB - 1) {
       k = NB - 1 - j;
       if
       :: n > SHARE && HL(r, k) != 0 && !INFLIGHT(r, k) ->
          PO(r, k) = (HL(r, k) == 2 -> REL_CUR : REL_OLD);
          HL(r, k) = 0; SU(r, k) = 0; n--
       :: else
       fi
     };
     for (j : 0 .. NB - 1) {                           /* hand_off: marked buckets not in flight */
       if
       :: HOM(r, j) && !INFLIGHT(r, j) ->
          if
          :: HL(r, j) != 0 && PO(r, j) == 0 ->
             PO(r, j) = (HL(r, j) == 2 -> HOF_CUR : HOF_OLD); HL(r, j) = 0; SU(r, j) = 0
          :: else
          fi;
          HOM(r, j) = 0
       :: else
       fi
     }
  :: else
  fi;
  n = 0; x = 0; k = 0
}

#ifdef LIVE
/* the fair share ceil(BUCKETS / live relays), live = heartbeat within one lease */
#if NR > 2
#define LIVECOUNT ((hb[0] > 0) + (hb[1] > 0) + (hb[2] > 0))
#else
#define LIVECOUNT ((hb[0] > 0) + (hb[1] > 0))
#endif
#define FAIRSHARE ((NB + LIVECOUNT - 1) / LIVECOUNT)
#endif

/* release_buckets / hand_off_buckets: WHERE owner = relay AND token = token */
inline bucket_statement(r, b) {
  if
  :: PO(r, b) == REL_CUR ->
     assert(own[b] == nm[r]);
     end_epoch(b); own[b] = 0; rem[b] = 0;             /* owner NULL, expires_at '-infinity' */
     printf("R%d: releases bucket %d\n", r, b)
  :: PO(r, b) == HOF_CUR ->
     assert(own[b] == nm[r]);
     end_epoch(b); own[b] = 0; rem[b] = LEASE;         /* reserved for the peer for a lease */
     printf("R%d: hands bucket %d over\n", r, b);
     if
     :: nm[r] != 1 -> hof[b] = 1
     :: nm[r] != 2 -> hof[b] = 2
#if NR > 2
     :: nm[r] != 3 -> hof[b] = 3
#endif
     :: hof[b] = GHOST
     fi
  :: else -> printf("R%d: release / hand-off of bucket %d matches no row (token superseded)\n", r, b)
  fi;
  PO(r, b) = 0
}

#if NB > 1
#define NO_PENDING(r) (PO(r, 0) == 0 && PO(r, 1) == 0)
#else
#define NO_PENDING(r) (PO(r, 0) == 0)
#endif
#if FENCE == 2
/* the renewal UPDATE waits for the share locks the relay's own completions hold */
#define RENEWABLE(r) ((sl[0] == 0 || HL(r, 0) == 0) && (sl[NB - 1] == 0 || HL(r, NB - 1) == 0))
#else
#define RENEWABLE(r) true
#endif
#define ROUND_OK(r) (nm[r] != 0 && NO_PENDING(r) && RENEWABLE(r))

proctype Member(byte r) {
end_member:
  do
#ifdef LIVE
  :: d_step { ROUND_OK(r) -> hb[r] = LEASE; round(r, 1, FAIRSHARE) }
#ifndef NO_LOST_ANSWER
  :: d_step { ROUND_OK(r) && CHAOS_OK -> SPEND; hb[r] = LEASE; round(r, 0, FAIRSHARE) }
#endif
#else
  /* safety: the fair share is a free choice among its values (NB = 2: 1 with two live relays
   * or more, 2 alone; NB = 1: 0 or 1, whether the relay wants this bucket or one more) */
  :: d_step { ROUND_OK(r) -> round(r, 1, NB - 1) }
  :: d_step { ROUND_OK(r) -> round(r, 1, NB) }
#ifndef NO_LOST_ANSWER
  :: d_step { ROUND_OK(r) -> round(r, 0, NB - 1) }
  :: d_step { ROUND_OK(r) -> round(r, 0, NB) }
#endif
#endif
  :: atomic { nm[r] != 0 && PO(r, 0) != 0 -> bucket_statement(r, 0) }
#if NB > 1
  :: atomic { nm[r] != 0 && PO(r, 0) == 0 && PO(r, 1) != 0 -> bucket_statement(r, 1) }
#endif
  od
}

/* ------------------------------------------------------------------ the batch */
#define DUE(r,m) (nm[r] != 0 && ph[r] == IDLE && st[m] == PENDING && HL(r, BK(m)) != 0 && HOM(r, BK(m)) == 0)
/* the fence: owner = relay AND token = token AND expires_at > now() */
#define FENCED(r) (own[BUCKET(r)] == nm[r] && bt[r] == 2 && rem[BUCKET(r)] > 0)
#ifdef BUG_NO_TOKEN
#define ROW_PASSES(r) (st[br[r]] == PENDING && own[BUCKET(r)] == nm[r] && rem[BUCKET(r)] > 0)
#else
#define ROW_PASSES(r) (st[br[r]] == PENDING && FENCED(r))
#endif

/* the UPDATE of complete_in_buckets for the batch's row: a PENDING row that passes the fence is
 * updated and stays locked until COMMIT (FENCE=2: the bucket row is share-locked too); a row
 * that does not is left alone (lost_leases) */
inline update(r) {
  if
  :: ROW_PASSES(r) ->
     assert(FENCED(r));                                /* property 2 at the statement */
     printf("R%d: UPDATE m%d passes the fence (takeover pre-count: %d); row locked until COMMIT\n", r, br[r], ck[r]);
     lk[br[r]] = r + 1;
#if FENCE == 2
     sl[BUCKET(r)] = sl[BUCKET(r)] | (1 << r);
#endif
     skip
  :: else -> printf("R%d: UPDATE m%d matches no row (fenced out or not PENDING)\n", r, br[r])
  fi;
  ph[r] = OPEN
}

/* the broker receives the message. CLAIM_EXCLUSIVE_PUBLISH asserts the claim the code does NOT
 * make: that a relay publishes only while it holds an unexpired lease with the current token
 * (a paused relay may publish after losing its lease; only its completion is refused) */
#define SAYPUB(r) printf("R%d: publishes m%d, attempt %d (token current: %d, lease unexpired: %d)\n", r, br[r], ATTEMPT(r), bt[r] == 2, rem[BUCKET(r)] > 0)
#ifdef CLAIM_EXCLUSIVE_PUBLISH
#define PUBLISH(r) assert(FENCED(r))
#else
#define PUBLISH(r) skip
#endif

inline unlock_bucket(r) {
#if FENCE == 2
  sl[BUCKET(r)] = sl[BUCKET(r)] & ~(1 << r);
#endif
  skip
}

/* take_batch: a row of a bucket no longer held with the token of the read is dropped (TAKE_NOW:
 * no longer held at all); otherwise it takes the token and is counted if the bucket is suspect; then process_inner's takeover step: record an
 * attempt first, or dead-letter the row when attempts are exhausted */
#ifdef TAKE_NOW
#define SAME_LEASE(r) true
#else
#define SAME_LEASE(r) (rt[r] == HL(r, BUCKET(r)))
#endif
inline take_batch(r) {
  if
  :: HL(r, BUCKET(r)) != 0 && SAME_LEASE(r) ->
     bt[r] = HL(r, BUCKET(r)); bk[r] = SU(r, BUCKET(r)); SU(r, BUCKET(r)) = 0;
     printf("R%d: reads m%d (attempts %d) of bucket %d (token current: %d, takeover batch: %d)\n", r, br[r], bs[r], BUCKET(r), bt[r] == 2, bk[r]);
     if
     :: bk[r] ->
#ifdef BUG_PRECOUNT_UNCAPPED
        bs[r]++; ck[r] = 1
#else
        if
        :: bs[r] + 1 > MAXATT -> bo[r] = O_FAILED         /* relay stopped while publishing it */
        :: else -> bs[r]++; ck[r] = 1
        fi
#endif
     :: else
     fi;
     ph[r] = READY
  :: else -> clear_batch(r)
  fi
}
#ifdef TAKE_GAP
#define TAKE(r) printf("R%d: read_buckets returns m%d (attempts %d); take_batch not run yet\n", r, br[r], bs[r])
#else
#define TAKE(r) take_batch(r)
#endif

proctype Batcher(byte r) {
end_batcher:
  do
  /* read_buckets: a due PENDING row of a held bucket that is not in flight (which one is for
   * batch_size, available_at and the keys held back to decide); nothing is written. With
   * TAKE_GAP, take_batch is a later step (the membership task may run in between). */
  :: d_step { DUE(r, 0) -> br[r] = 0; bs[r] = att[0]; rt[r] = HL(r, BK(0)); ph[r] = READ; TAKE(r) }
#if NM > 1
  :: d_step { DUE(r, 1) -> br[r] = 1; bs[r] = att[1]; rt[r] = HL(r, BK(1)); ph[r] = READ; TAKE(r) }
#endif
#if NM > 2
  :: d_step { DUE(r, 2) -> br[r] = 2; bs[r] = att[2]; rt[r] = HL(r, BK(2)); ph[r] = READ; TAKE(r) }
#endif
#ifdef TAKE_GAP
  :: d_step { ph[r] == READ -> take_batch(r) }
#endif
  /* the pre-count statement: UPDATE (waits for the row lock) */
  :: atomic { ph[r] == READY && ck[r] && lk[br[r]] == 0 -> update(r) }
  /* leases_fresh, publish, then the completion statement's UPDATE */
  :: atomic {
       ph[r] == READY && !ck[r] && lk[br[r]] == 0 ->
       if
       :: bo[r] != O_NONE -> update(r)                 /* outcome known: not published (again) */
       :: bo[r] == O_NONE ->
          if
          :: PUBLISH(r); bo[r] = O_SENT; SAYPUB(r); printf("    broker: acknowledged\n"); update(r)
          :: PUBLISH(r); bo[r] = O_FAILED; SAYPUB(r); printf("    broker: permanent error, or retryable at the last attempt: dead letter\n"); update(r)
          :: ATTEMPT(r) < MAXATT -> PUBLISH(r); bo[r] = O_RETRY; SAYPUB(r); printf("    broker: retryable error\n"); update(r)
          :: UNAVAILABLE && CHAOS_OK -> SPEND; bo[r] = O_RELEASE;       /* no attempt */
             printf("R%d: broker unavailable: m%d released, no attempt\n", r, br[r]); update(r)
          :: HANDOFF && CHAOS_OK -> SPEND; bo[r] = O_RELEASE; HOM(r, BUCKET(r)) = 1; /* a peer routes it */
             printf("R%d: no route for m%d here: released, bucket marked for hand-over\n", r, br[r]); update(r)
          :: STALE_SKIP && CHAOS_OK -> SPEND;          /* lease nearly expired */
             printf("R%d: lease nearly expired: m%d not published\n", r, br[r]); clear_batch(r)
          fi
       fi
     }
  /* COMMIT */
  :: d_step {
       ph[r] == OPEN ->
       if
       :: lk[br[r]] == r + 1 ->
#if defined(P2_OTHER_OWNER)
          /* no other relay holds the bucket's current lease with this row in its batch */
          assert(!(own[BUCKET(r)] != nm[r] && own[BUCKET(r)] != 0 && ph[own[BUCKET(r)] - 1] >= READY &&
                   br[own[BUCKET(r)] - 1] == br[r] && bt[own[BUCKET(r)] - 1] == 2));
#elif !defined(P2_SNAPSHOT)
          assert(own[BUCKET(r)] == nm[r] && bt[r] == 2);   /* property 2 at COMMIT */
#endif
          printf("R%d: COMMIT m%d\n", r, br[r]);
          x = (ck[r] -> bs[r] : (bo[r] == O_RELEASE -> bs[r] : ATTEMPT(r)));
#ifdef MONO
          assert(x >= att[br[r]]);
#endif
          att[br[r]] = x;
          if
          :: ck[r] -> skip                             /* pre-count: Release, attempts + 1 */
          :: !ck[r] && bo[r] == O_SENT -> st[br[r]] = SENT
          :: !ck[r] && bo[r] == O_FAILED -> st[br[r]] = FAILED
          :: else                                      /* Retry, Release: stays PENDING */
          fi;
          printf("    m%d: status %d, attempts %d\n", br[r], st[br[r]], att[br[r]]);
          assert(att[br[r]] <= ATTBOUND);              /* property 3 */
          lk[br[r]] = 0
       :: else
       fi;
       unlock_bucket(r);
       x = 0;
       if
       :: ck[r] -> ck[r] = 0; ph[r] = READY            /* on to publishing */
       :: else -> clear_batch(r)                       /* the batch ends: out of flight */
       fi
     }
  /* a database error: ROLLBACK; retried, or given up once the lease would have run out */
  :: atomic {
       ph[r] == OPEN && DB_ERRORS && CHAOS_OK -> SPEND;
       printf("R%d: database error: ROLLBACK\n", r);
       if :: lk[br[r]] == r + 1 -> lk[br[r]] = 0 :: else fi;
       unlock_bucket(r);
       if
       :: ph[r] = READY
       :: clear_batch(r)
       fi
     }
  od
}

/* ------------------------------------------------------------------ environment */
/* ZOMBIE: the relay is cut off from the database (network partition, hung host) between its
 * UPDATE and its COMMIT: the relay is gone (it restarts elsewhere or not), but the database
 * keeps its session, transaction and locks (held by ZOMB) until it notices: TCP keepalive
 * (tcp_keepalives_idle, 2 h by default) or, with IDLE_TIMEOUT, idle_in_transaction_session_timeout. */
#define ZOMB 9
#define ZBIT 128
inline zombie(r) {
  if :: LOCKED(r) -> lk[br[r]] = ZOMB :: else fi;
#if FENCE == 2
  for (j : 0 .. NB - 1) { if :: (sl[j] & (1 << r)) != 0 -> sl[j] = (sl[j] & ~(1 << r)) | ZBIT :: else fi };
#endif
  printf("R%d: cut off from the database between UPDATE and COMMIT; its session stays open\n", r)
}

/* A crash: the process dies at once, its connections close (an open transaction rolls back)
 * and its local state is gone; its heartbeat and bucket rows stay until they expire. */
inline crash(r) {
  if :: LOCKED(r) -> lk[br[r]] = 0 :: else fi;
#if FENCE == 2
  for (j : 0 .. NB - 1) { sl[j] = sl[j] & ~(1 << r) };
#endif
  for (j : 0 .. NB - 1) { HL(r, j) = 0; SU(r, j) = 0; HOM(r, j) = 0; PO(r, j) = 0 };
  clear_batch(r);
  nm[r] = 0;
  printf("R%d: crashes\n", r)
}

inline tick_all() {
  printf("tick (lease of bucket 0: %d tick(s) left before, owner R%d)\n", rem[0], own[0] - 1);
  for (j : 0 .. NB - 1) { if :: rem[j] > 0 -> rem[j]-- :: else fi };
#ifdef LIVE
  for (j : 0 .. NR - 1) { if :: hb[j] > 0 -> hb[j]-- :: else fi };
#endif
  skip
}

#ifdef LIVE
#if NR > 2
#define KEPT(b) ((nm[0] == own[b] && HL(0, b) == 2) || (nm[1] == own[b] && HL(1, b) == 2) || (nm[2] == own[b] && HL(2, b) == 2))
#define SOME_ALIVE (nm[0] != 0 || nm[1] != 0 || nm[2] != 0)
#else
#define KEPT(b) ((nm[0] == own[b] && HL(0, b) == 2) || (nm[1] == own[b] && HL(1, b) == 2))
#define SOME_ALIVE (nm[0] != 0 || nm[1] != 0)
#endif
/* once the faults are spent the running relays are timely (lease >= 3 x publish_timeout, a
 * round every lease / 3): the clock expires neither a lease a running relay holds and knows
 * of, nor its heartbeat; everything else expires as time goes by */
inline tick_timely() {
  for (j : 0 .. NB - 1) { if :: rem[j] > 0 && !(own[j] != 0 && KEPT(j)) -> rem[j]-- :: else fi };
  for (j : 0 .. NR - 1) { if :: hb[j] > 0 && nm[j] == 0 -> hb[j]-- :: else fi };
  skip
}
#endif

#ifdef LIVE
/* relay r paused past its lease (a fault): its leases and its heartbeat run out while its
 * local state stays as it was */
#define PAUSE(r) :: d_step { nm[r] != 0 && chaos > 0 -> chaos--; \
                             for (j : 0 .. NB - 1) { if :: own[j] == nm[r] -> rem[j] = 0 :: else fi }; \
                             hb[r] = 0; printf("R%d: paused past its lease\n", r) }
#endif
#define CRASH(r) :: atomic { nm[r] != 0 && CHAOS_OK -> SPEND; crash(r) }
#ifdef ZOMBIE
#define ZOMBIE_OF(r) :: atomic { nm[r] != 0 && LOCKED(r) && CHAOS_OK -> SPEND; zombie(r); crash(r) }
#else
#define ZOMBIE_OF(r)
#endif
#define RESTART(r) :: atomic { nm[r] == 0 -> nm[r] = r + 1; printf("R%d: restarts\n", r) }
#ifdef CHECK_BACK
#ifdef CB_KEEP
#define CB_ATTEMPTS(m) skip
#else
#define CB_ATTEMPTS(m) att[m] = 0
#endif
#define CHECKBACK(m) :: atomic { st[m] == SENT && lk[m] == 0 -> \
                               if :: cb[m] >= MAXCB -> st[m] = FAILED \
                                  :: else -> st[m] = PENDING; cb[m]++; CB_ATTEMPTS(m) fi; \
                               printf("check-back: m%d unconfirmed by its deadline: status %d, attempts %d\n", m, st[m], att[m]) }
#endif

active proctype Env() {
end_env:
  do
#ifdef LIVE
  :: d_step { tick_timely() }
  PAUSE(0)
#if NR > 1
  PAUSE(1)
#endif
#if NR > 2
  PAUSE(2)
#endif
#else
  :: d_step { tick_all() }
#endif
  CRASH(0)
  ZOMBIE_OF(0)
  RESTART(0)
#if NR > 1
  CRASH(1)
  ZOMBIE_OF(1)
  RESTART(1)
#endif
#if NR > 2
  CRASH(2)
  ZOMBIE_OF(2)
  RESTART(2)
#endif
#ifdef CHECK_BACK
  CHECKBACK(0)
#if NM > 1
  CHECKBACK(1)
#endif
#if NM > 2
  CHECKBACK(2)
#endif
#endif
  od
}

#ifdef IDLE_TIMEOUT
/* the server ends a session idle in a transaction: it rolls back and its locks go */
proctype Reaper() {
end_reaper:
  do
  :: d_step {
       (lk[0] == ZOMB || lk[NM - 1] == ZOMB || lk[(NM - 1) / 2] == ZOMB
#if FENCE == 2
        || (sl[0] & ZBIT) != 0 || (sl[NB - 1] & ZBIT) != 0
#endif
       ) ->
       for (j : 0 .. NM - 1) { if :: lk[j] == ZOMB -> lk[j] = 0 :: else fi };
#if FENCE == 2
       for (j : 0 .. NB - 1) { sl[j] = sl[j] & ~ZBIT };
#endif
       printf("server: idle_in_transaction_session_timeout ends the cut-off session (rolled back)\n")
     }
  od
}
#endif

init {
  atomic {
    for (j : 0 .. NM - 1) { st[j] = PENDING };         /* committed by their producers */
    for (j : 0 .. NR - 1) { nm[j] = j + 1; run Member(j); run Batcher(j) };
#ifdef IDLE_TIMEOUT
    run Reaper();
#endif
    j = 0
  }
}

#ifdef LIVE
#define TERM(m) (st[m] == SENT || st[m] == FAILED)
#if NM > 2
#define ALL_DONE (TERM(0) && TERM(1) && TERM(2))
#elif NM > 1
#define ALL_DONE (TERM(0) && TERM(1))
#else
#define ALL_DONE TERM(0)
#endif
ltl live { (<>[] SOME_ALIVE) -> <>[] ALL_DONE }
#endif
