// Package nodeident is the node identity core: the one place that checks a
// presented node certificate (Check), issues one (Issue), and records a
// refused join, renewal or session (Refused). JoinService (token joins,
// reclaims, x509pop re-joins), renewal and SessionService all go through
// it, so their rules cannot drift apart.
//
// Who may import it: internal/controlplane/join (and its attestors), internal/controlplane/session,
// and the API wiring. Never the gateway or bcd: it holds the node CA's key
// and reads the store (a dependency test enforces that).
//
// SECURITY: the gateway relays every byte between bcd and the API, and a
// node certificate is public (every TLS handshake shows it). A presented
// certificate therefore proves nothing by itself: Check matches it byte for
// byte against node_certs and takes the caller's proof of possession of its
// key (a signature over something the caller could not have replayed) as a
// separate input. Refusals are routed to the node's tenant only once that
// proof verified; before, to the root tenant, so an unauthenticated caller
// cannot write into a tenant's stream.
package nodeident

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/better-compute/better-compute/internal/controlplane/apimetrics"
	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/events"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/errs"
	"github.com/better-compute/better-compute/internal/shared/pki"
	"github.com/better-compute/better-compute/internal/shared/ratelimit"
)

// Certificate lifetimes (R7.1).
const (
	MaxCertTTL        = 24 * time.Hour
	MaxRamdiskCertTTL = 2 * time.Hour
	// backdate allows for node clocks a little behind the server's.
	backdate = 5 * time.Minute
)

// SessionOverlap is how long a certificate superseded by a renewal keeps
// authenticating sessions. bcd renews at about 60% of the lifetime and
// moves its session to the new certificate at once; the overlap lets a
// session that is being re-established, or an API replica that has not yet
// seen the renewal commit, not be cut. Renewal and x509pop never accept a
// superseded certificate.
const SessionOverlap = 5 * time.Minute

// MaxExpiredFor is how long after its expiry a certificate still re-joins
// its node through x509pop (R10.5).
const MaxExpiredFor = 7 * 24 * time.Hour

// Config lists the core's dependencies.
type Config struct {
	DB *store.DB
	// Bundle is the machine PKI; Issue needs it.
	Bundle *ca.Bundle
	Clock  clock.Clock
	Log    *slog.Logger
	Hub    *events.Hub
	// CertTTL is certTtlSeconds: default and maximum 24 h.
	CertTTL time.Duration
	// SVIDForm is where issued certificates carry their statements
	// (pki.SVIDFormPage, the default, or pki.SVIDFormStrict; R20.1). It
	// applies to every issue, so a renewal moves a node to it: the
	// statements themselves come from the node_certs row, in either form.
	SVIDForm string
	// Limiter bounds refusal events: 60 per tenant, kind, attestor and
	// reason per minute by default.
	Limiter *events.Limiter
	// LogLimiter bounds refusal log lines, by the same key: 10 per minute
	// by default (LogLinesPerMinute).
	LogLimiter *ratelimit.Limiter
	// Metrics, when set, counts issued certificates and suppressed
	// refusal events.
	Metrics *apimetrics.API
}

// LogLinesPerMinute is how many log lines a refusal key (tenant, kind,
// attestor and reason) writes per minute by default; each line says how
// many of the key's were suppressed since the last.
const LogLinesPerMinute = 10

// Core is the identity core. Build it with New; one is shared by
// JoinService and SessionService so refusals share one limiter.
type Core struct {
	cfg     Config
	db      *store.DB
	log     *slog.Logger
	clock   clock.Clock
	limiter *events.Limiter
	// lines writes refusal log lines (rate-limited, naming the peer).
	lines *ratelimit.Logger
	// root caches the root tenant's id: it never changes once bootstrap
	// set it.
	root atomic.Pointer[string]
}

// New returns the core.
func New(cfg Config) (*Core, error) {
	if cfg.DB == nil {
		return nil, errors.New("nodeident: a store is required")
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.Real{}
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.CertTTL == 0 {
		cfg.CertTTL = MaxCertTTL
	}
	if cfg.CertTTL < time.Minute || cfg.CertTTL > MaxCertTTL {
		return nil, errs.New(errs.InvalidConfig, "certTtlSeconds must be from 60 to 86400")
	}
	if !pki.ValidSVIDForm(cfg.SVIDForm) {
		return nil, errs.New(errs.InvalidConfig, "svid_form must be %q or %q", pki.SVIDFormPage, pki.SVIDFormStrict)
	}
	if cfg.Limiter == nil {
		cfg.Limiter = events.NewLimiter(cfg.Clock, 60, time.Minute)
	}
	if cfg.LogLimiter == nil {
		cfg.LogLimiter = ratelimit.New(cfg.Clock, LogLinesPerMinute, time.Minute)
	}
	return &Core{cfg: cfg, db: cfg.DB, log: cfg.Log, clock: cfg.Clock, limiter: cfg.Limiter,
		lines: ratelimit.NewLogger(cfg.Log, cfg.LogLimiter)}, nil
}

// Bundle returns the machine PKI (nil when none is configured).
func (c *Core) Bundle() *ca.Bundle { return c.cfg.Bundle }

// Clock returns the core's clock.
func (c *Core) Clock() clock.Clock { return c.clock }

// RootTenant returns the root tenant's id, reading it until bootstrap has
// set it ("" before) and from the cache after.
func (c *Core) RootTenant(ctx context.Context, tx *store.Tx) (string, error) {
	if id := c.root.Load(); id != nil {
		return *id, nil
	}
	id, err := tx.RootTenantID(ctx)
	if err != nil || id == "" {
		return id, err
	}
	c.root.Store(&id)
	return id, nil
}

// Family is the token role behind a certificate role: node-tenant is a node
// that a hosted token made tenant-controlled.
func Family(role string) string {
	if role == pki.RoleNodeTenant {
		return pki.RoleNode
	}
	return role
}
