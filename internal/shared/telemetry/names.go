// Package telemetry is the one place that names what better-compute's
// processes tell operators: every Prometheus metric name, label key and
// label value set, every structured log key, and the log handler every
// process builds from its log.format and log.level settings.
//
// SECURITY and cost: every label value comes from a fixed set decided here
// or from the process's own config (an upstream URL), never from what a
// caller sent, so a flood of requests cannot grow the number of series.
package telemetry

// Metric names. The API's (a control plane replica's).
const (
	APIRequests         = "bc_api_requests_total"
	APIRequestSeconds   = "bc_api_request_seconds"
	SessionsHeld        = "bc_sessions_held"
	SessionsOpened      = "bc_sessions_opened_total"
	SessionHeartbeats   = "bc_session_heartbeats_total"
	Joins               = "bc_joins_total"
	JoinPhaseSeconds    = "bc_join_phase_seconds"
	Renewals            = "bc_renewals_total"
	TokenSpends         = "bc_token_spends_total"
	JoinRequests        = "bc_join_requests"
	JoinRequestsDecided = "bc_join_requests_decided_total"
	CertificatesIssued  = "bc_certificates_issued_total"
	KeyExpirySeconds    = "bc_pki_key_expiry_seconds"
	Commands            = "bc_commands_total"
	RefusalsSuppressed  = "bc_refusal_events_suppressed_total"

	// The export of events and audit rows to sinks (R17.4), on the
	// replica holding the export lease.
	ExportRows       = "bc_export_rows_total"
	ExportErrors     = "bc_export_errors_total"
	ExportLagSeconds = "bc_export_lag_seconds"
)

// Metric names of a gateway.
const (
	GatewaySessionsHeld   = "bc_gateway_sessions_held"
	GatewaySessionsOpened = "bc_gateway_sessions_opened_total"
	GatewayRelayErrors    = "bc_gateway_relay_errors_total"
	GatewayUpstreamUp     = "bc_gateway_upstream_up"
	GatewayCertExpiry     = "bc_gateway_certificate_expiry_seconds"
)

// Metric names of bcd.
const (
	NodeRenewals          = "bc_node_renewals_total"
	NodeSessionReconnects = "bc_node_session_reconnects_total"
	NodeCertExpiry        = "bc_node_certificate_expiry_seconds"
)

// Label keys.
const (
	LabelPath     = "path"
	LabelCode     = "code"
	LabelAttestor = "attestor"
	LabelRole     = "role"
	LabelOutcome  = "outcome"
	LabelReason   = "reason"
	LabelPhase    = "phase"
	LabelState    = "state"
	LabelDecision = "decision"
	LabelKey      = "key"
	LabelEvent    = "event"
	LabelKind     = "kind"
	LabelUpstream = "upstream"
	// LabelSink is an export sink's name (from the config: bounded).
	LabelSink = "sink"
)

// Outcomes of a join or a renewal (LabelOutcome).
const (
	OutcomeAdmitted = "admitted"
	OutcomeRefused  = "refused"
	// OutcomeDeferred is a join waiting on a person's approval (a join
	// request).
	OutcomeDeferred = "deferred"
	// OutcomeConflict is the loser of two racing joins of one machine.
	OutcomeConflict = "conflict"
	// OutcomeChallenged is the first leg of a two-leg attestor (tpm).
	OutcomeChallenged = "challenged"
	// OutcomeError is any other failure (the store, the PKI missing).
	OutcomeError = "error"
	// OutcomeOK and OutcomeFailed are bcd's renewals.
	OutcomeOK     = "ok"
	OutcomeFailed = "failed"
)

// Join phases (LabelPhase): check is the request's shape, CSR and seal
// (before any database work); admit is the transaction (attest, decide,
// sign, commit). Seal, attest, sign and commit are parts of those two:
// seal is opening the sealed token (in check); attest is the attestor's
// verification, sign the certificate's issuance (both inside the
// transaction, once per attempt); commit is from the transaction's last
// statement to its commit returning, the group commit's wait included.
const (
	PhaseCheck  = "check"
	PhaseAdmit  = "admit"
	PhaseSeal   = "seal"
	PhaseAttest = "attest"
	PhaseSign   = "sign"
	PhaseCommit = "commit"
)

// Command events (LabelEvent).
const (
	CommandEnqueued  = "enqueued"
	CommandDelivered = "delivered"
	CommandExpired   = "expired"
	// CommandAnswered is a command whose node's result was stored (done
	// or failed).
	CommandAnswered = "answered"
)

// Join request decisions (LabelDecision) and states (LabelState).
const (
	DecisionApproved = "approved"
	DecisionRejected = "rejected"
	// DecisionExpired is an approval that ran out unused.
	DecisionExpired = "expired"
)

// Log keys: the same on every process. bcd's packages use only these
// (TestNodeLogKeysR17_3 checks).
const (
	LogNodeID   = "node_id"
	LogTenant   = "tenant"
	LogAttestor = "attestor"
	LogReason   = "reason"
	LogTraceID  = "trace_id"
	LogSpanID   = "span_id"
	LogPeer     = "peer"
	LogErr      = "err"

	// LogGateway is the gateway a node dials (its URL or host).
	LogGateway = "gateway"
	// LogCommand is a command's id; LogKind a command's or a pin set's
	// kind.
	LogCommand = "command"
	LogKind    = "kind"
	// LogSerial and LogPreviousSerial are certificate serials; LogNotAfter
	// a certificate's expiry (RFC 3339).
	LogSerial         = "serial"
	LogPreviousSerial = "previous_serial"
	LogNotAfter       = "not_after"
	// LogAttempt counts the failures in a row; LogRetryIn and
	// LogReconnectIn are the waits before the next try; LogMargin how long
	// before expiry a certificate counts as expiring; LogHeartbeat a
	// session's heartbeat interval.
	LogAttempt     = "attempt"
	LogRetryIn     = "retry_in"
	LogReconnectIn = "reconnect_in"
	LogMargin      = "margin"
	LogHeartbeat   = "heartbeat"
	// LogAddr is a listener's address; LogState a systemd notify state.
	LogAddr  = "addr"
	LogState = "state"
	// LogFile and LogConfig are paths; LogLines and LogMachines counts of
	// a site's booted-machines file.
	LogFile       = "file"
	LogConfigFile = "config"
	LogLines      = "lines"
	LogMachines   = "machines"
	// LogSource is where learned keys came from (welcome, keys, join);
	// LogAdded, LogRetired and LogPins what a pin set learned and holds;
	// LogStatements the key statements a gateway offered.
	LogSource     = "source"
	LogAdded      = "added"
	LogRetired    = "retired"
	LogPins       = "pins"
	LogStatements = "statements"
	// LogWarning is a hardware claim's warning.
	LogWarning = "warning"
)
