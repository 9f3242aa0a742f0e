// Package apimetrics is the API's fleet metrics (R17.1): joins, their
// phases, renewals, token spends, join-request decisions, certificates,
// commands and sessions, counted on a Prometheus registry under the names
// of internal/shared/telemetry. It is the control plane's own, so that bcd,
// which imports telemetry for its names and logging, links no Prometheus
// client.
package apimetrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/better-compute/better-compute/internal/shared/telemetry"
)

// phases are the join phases in the order API.Phase indexes them.
var phases = [...]string{telemetry.PhaseCheck, telemetry.PhaseAdmit, telemetry.PhaseSeal, telemetry.PhaseAttest, telemetry.PhaseSign, telemetry.PhaseCommit}

// API is a control plane replica's metrics of what the fleet does. Every
// method is safe on a nil *API (a service built without metrics, in tests).
type API struct {
	joins      *prometheus.CounterVec
	phase      *prometheus.HistogramVec
	renewals   *prometheus.CounterVec
	spends     prometheus.Counter
	decided    *prometheus.CounterVec
	issued     *prometheus.CounterVec
	commands   *prometheus.CounterVec
	suppressed *prometheus.CounterVec
	opened     prometheus.Counter
	heartbeats prometheus.Counter

	// admitted caches the pre-curried counters of admitted joins by
	// attestor and role (the hot path: no label hashing and no allocation
	// per join).
	mu       sync.RWMutex
	admitted map[string]map[string]prometheus.Counter
	phases   [len(phases)]prometheus.Observer
}

// NewAPI registers the API's fleet metrics on reg.
func NewAPI(reg prometheus.Registerer) *API {
	m := &API{
		admitted: map[string]map[string]prometheus.Counter{},
		joins: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.Joins,
			Help: "Joins by attestor, role and outcome (admitted, refused, deferred, conflict, challenged, error); reason is the refusal reason, empty otherwise."},
			[]string{telemetry.LabelAttestor, telemetry.LabelRole, telemetry.LabelOutcome, telemetry.LabelReason}),
		phase: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: telemetry.JoinPhaseSeconds,
			Help:    "Join latency by phase: check (shape, CSR, seal), admit (the transaction: attest, decide, sign, commit); within them seal (opening the sealed token), attest (the attestor's verification), sign (certificate issuance) and commit (the commit, group commit wait included).",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5}}, []string{telemetry.LabelPhase}),
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.Renewals,
			Help: "Renewals by role (empty before the certificate was checked), outcome (admitted, refused, error) and refusal reason."},
			[]string{telemetry.LabelRole, telemetry.LabelOutcome, telemetry.LabelReason}),
		spends: prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.TokenSpends, Help: "Join token uses spent by admitted joins."}),
		decided: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.JoinRequestsDecided,
			Help: "Join requests decided, by decision: approved, rejected (by a person), expired (an approval that ran out unused)."}, []string{telemetry.LabelDecision}),
		issued: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.CertificatesIssued,
			Help: "Node certificates issued (joins and renewals), by role."}, []string{telemetry.LabelRole}),
		commands: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.Commands,
			Help: "Commands by event (enqueued, delivered to a session, answered: the node's result stored, expired)."}, []string{telemetry.LabelEvent}),
		suppressed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: telemetry.RefusalsSuppressed,
			Help: "Refusal events the limiter did not record, by kind (join, renew, session)."}, []string{telemetry.LabelKind}),
		opened:     prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.SessionsOpened, Help: "Node sessions this replica opened (welcomed)."}),
		heartbeats: prometheus.NewCounter(prometheus.CounterOpts{Name: telemetry.SessionHeartbeats, Help: "Session heartbeats this replica verified."}),
	}
	for i, p := range phases {
		m.phases[i] = m.phase.WithLabelValues(p)
	}
	for _, d := range []string{telemetry.DecisionApproved, telemetry.DecisionRejected, telemetry.DecisionExpired} {
		m.decided.WithLabelValues(d)
	}
	for _, e := range []string{telemetry.CommandEnqueued, telemetry.CommandDelivered, telemetry.CommandAnswered, telemetry.CommandExpired} {
		m.commands.WithLabelValues(e)
	}
	reg.MustRegister(m.joins, m.phase, m.renewals, m.spends, m.decided, m.issued, m.commands, m.suppressed, m.opened, m.heartbeats)
	return m
}

// Join counts one join's outcome; reason is the refusal reason (empty
// unless refused).
func (m *API) Join(attestor, role, outcome, reason string) {
	if m == nil {
		return
	}
	attestor, role = telemetry.Attestor(attestor), telemetry.Role(role)
	if outcome == telemetry.OutcomeAdmitted {
		m.mu.RLock()
		c, ok := m.admitted[attestor][role]
		m.mu.RUnlock()
		if !ok {
			c = m.joins.WithLabelValues(attestor, role, outcome, "")
			m.mu.Lock()
			if m.admitted[attestor] == nil {
				m.admitted[attestor] = map[string]prometheus.Counter{}
			}
			m.admitted[attestor][role] = c
			m.mu.Unlock()
		}
		c.Inc()
		return
	}
	if reason != "" {
		reason = telemetry.Reason(reason)
	}
	m.joins.WithLabelValues(attestor, role, outcome, reason).Inc()
}

// Phase observes how long a join phase (a Phase constant) took; another
// phase name is not counted.
func (m *API) Phase(phase string, d time.Duration) {
	if m == nil {
		return
	}
	for i, p := range phases {
		if p == phase {
			m.phases[i].Observe(d.Seconds())
			return
		}
	}
}

// Renewal counts one renewal's outcome.
func (m *API) Renewal(role, outcome, reason string) {
	if m == nil {
		return
	}
	if reason != "" {
		reason = telemetry.Reason(reason)
	}
	m.renewals.WithLabelValues(telemetry.Role(role), outcome, reason).Inc()
}

// TokenSpent counts a join token use spent.
func (m *API) TokenSpent() {
	if m != nil {
		m.spends.Inc()
	}
}

// Decided counts a join request approved or rejected.
func (m *API) Decided(decision string) {
	if m != nil {
		m.decided.WithLabelValues(decision).Inc()
	}
}

// Issued counts a node certificate issued for role.
func (m *API) Issued(role string) {
	if m != nil {
		m.issued.WithLabelValues(telemetry.Role(role)).Inc()
	}
}

// Command counts n commands reaching event.
func (m *API) Command(event string, n int) {
	if m != nil && n > 0 {
		m.commands.WithLabelValues(event).Add(float64(n))
	}
}

// Suppressed counts a refusal event the limiter dropped.
func (m *API) Suppressed(kind string) {
	if m != nil {
		m.suppressed.WithLabelValues(kind).Inc()
	}
}

// SessionOpened counts a session welcomed.
func (m *API) SessionOpened() {
	if m != nil {
		m.opened.Inc()
	}
}

// Heartbeat counts a session heartbeat verified.
func (m *API) Heartbeat() {
	if m != nil {
		m.heartbeats.Inc()
	}
}
