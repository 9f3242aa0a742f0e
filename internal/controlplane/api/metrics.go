package api

import (
	"context"
	"crypto/x509"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/controlplane/ca"
	"github.com/better-compute/better-compute/internal/controlplane/store"
	"github.com/better-compute/better-compute/internal/shared/clock"
	"github.com/better-compute/better-compute/internal/shared/telemetry"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
)

// OtherRoute is the metrics label of every request that matches no route:
// unknown paths, unknown procedures, malformed paths.
const OtherRoute = "other"

// operatorProcedures lists every operator API procedure,
// "/bettercompute.v1.NodeService/GetNode", read from the schema so a new
// RPC is labelled without a change here.
func operatorProcedures() map[string]bool {
	out := map[string]bool{}
	svcs := bcv1.File_bettercompute_v1_api_proto.Services()
	for i := range svcs.Len() {
		svc := svcs.Get(i)
		for j := range svc.Methods().Len() {
			out["/"+string(svc.FullName())+"/"+string(svc.Methods().Get(j).Name())] = true
		}
	}
	return out
}

// RouteLabel names the route r takes, for metrics: the procedure
// ("/bettercompute.v1.NodeService/GetNode") for an operator API call, the
// mux pattern ("GET /healthz", "GET /api/compute/downloads/bcd/{version}/{file}")
// for the other routes, and OtherRoute for anything else.
//
// SECURITY: the label is decided before authentication, so it must come
// from a bounded set: labelling by the raw path let unauthenticated
// requests to 100,000 distinct paths grow the API from 39 MB to 302 MB of
// metric series. Nothing the caller writes becomes a
// label.
func (s *Server) RouteLabel(r *http.Request) string {
	if rest, ok := strings.CutPrefix(r.URL.Path, s.cfg.BasePath); ok && s.procedures[rest] {
		return rest
	}
	// The same procedure at the root path (R20.4) has the same label.
	if s.procedures[r.URL.Path] {
		return r.URL.Path
	}
	_, pattern := s.mux.Handler(r)
	if pattern == "" || strings.HasSuffix(pattern, "/") {
		// No route, or a service prefix (an unknown procedure under
		// /bettercompute.v1.NodeService/), or a subtree fallback.
		return OtherRoute
	}
	return pattern
}

// joinRequestsCacheFor is how long a scrape reuses the open join request
// counts: a count per scrape, at most one per this, whatever the number of
// scrapers.
const joinRequestsCacheFor = 10 * time.Second

// joinRequestsCollector reports the open join requests by state (pending,
// approved) from a count read at scrape time, cached briefly.
type joinRequestsCollector struct {
	db    *store.DB
	clock clock.Clock
	desc  *prometheus.Desc

	mu     sync.Mutex
	at     time.Time
	counts map[string]int
}

func (c *joinRequestsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *joinRequestsCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.clock.Now()
	if c.counts == nil || now.Sub(c.at) >= joinRequestsCacheFor {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		var counts map[string]int
		err := c.db.ReadTx(ctx, func(tx *store.Tx) error {
			var err error
			counts, err = tx.CountOpenJoinRequests(ctx)
			return err
		})
		if err != nil {
			ch <- prometheus.NewInvalidMetric(c.desc, err)
			return
		}
		c.counts, c.at = counts, now
	}
	for _, state := range []string{store.JoinRequestPending, store.JoinRequestApproved} {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(c.counts[state]), state)
	}
}

// keyExpiryCollector reports, for each key of the machine PKI that has a
// certificate, the seconds until the earliest expiry among its accepted
// certificates (the current one and the rotation ring's), read from the
// live bundle at scrape time.
type keyExpiryCollector struct {
	bundle *ca.Bundle
	clock  clock.Clock
	desc   *prometheus.Desc
}

func (c *keyExpiryCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *keyExpiryCollector) Collect(ch chan<- prometheus.Metric) {
	b := c.bundle.Now()
	if b == nil {
		return
	}
	now := c.clock.Now()
	for kind, certs := range map[string][]*x509.Certificate{
		ca.KindNodeCA:         b.TrustedNodeCAs(),
		ca.KindServingCA:      b.TrustedServingCAs(),
		ca.KindCommandSigning: orCurrent(b.CommandCerts, b.CommandSigningCert),
		ca.KindJoinSigning:    {b.JoinSigningCert},
	} {
		var earliest time.Time
		for _, cert := range certs {
			if cert != nil && (earliest.IsZero() || cert.NotAfter.Before(earliest)) {
				earliest = cert.NotAfter
			}
		}
		if !earliest.IsZero() {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, earliest.Sub(now).Seconds(), kind)
		}
	}
}

func orCurrent(ring []*x509.Certificate, current *x509.Certificate) []*x509.Certificate {
	if len(ring) > 0 {
		return ring
	}
	return []*x509.Certificate{current}
}

// RegisterMetrics registers the API's fleet metrics on reg: the counters
// its services move (s.Metrics) and the collectors read at scrape time
// (open join requests, PKI key expiry).
func (s *Server) RegisterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(&joinRequestsCollector{db: s.cfg.DB, clock: s.cfg.Clock,
		desc: prometheus.NewDesc(telemetry.JoinRequests, "Open join requests by state (pending, approved), counted at most every 10 s.", []string{telemetry.LabelState}, nil)})
	if s.cfg.Bundle != nil {
		reg.MustRegister(&keyExpiryCollector{bundle: s.cfg.Bundle, clock: s.cfg.Clock,
			desc: prometheus.NewDesc(telemetry.KeyExpirySeconds, "Seconds until the earliest expiry of each machine PKI key's accepted certificates.", []string{telemetry.LabelKey}, nil)})
	}
}
