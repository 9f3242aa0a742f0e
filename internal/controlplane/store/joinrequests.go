package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"
)

// Join request states, as stored. "expired" is also what a reader shows for
// an approved request whose approval ran out (approved_until passed) before
// ExpireJoinRequest stored it.
const (
	JoinRequestPending  = "pending"
	JoinRequestApproved = "approved"
	JoinRequestRejected = "rejected"
	JoinRequestConsumed = "consumed"
	JoinRequestExpired  = "expired"
)

// JoinRequest is a join_requests row: a join an attestor deferred to a
// person (R10.1–R10.3). A machine has at most one open (pending or
// approved) request, found by its MachineKey (R10.2, opaque to the store).
type JoinRequest struct {
	ID, TenantID, PoolID, SiteID, Attestor, Role, MachineKey string
	// Claims is JSON, as the attestor saw them.
	Claims []byte
	// HardwareKey and EKHash are nil when the attestor saw none.
	HardwareKey, EKHash []byte
	// MAC, IP, WorkflowID and VouchedBy come from a site vouch (discovery).
	MAC, IP, WorkflowID, VouchedBy string
	// BootLeaseEpoch is the vouch's lease epoch; 0 when none.
	BootLeaseEpoch int64
	// CSRSHA256 is the SHA-256 of the request's CSR: an approval admits
	// this CSR once.
	CSRSHA256            []byte
	State                string
	CreatedAt, UpdatedAt time.Time
	DecidedAt            *time.Time
	DecidedBy, Reason    string
	ApprovedUntil        *time.Time
	ConsumedAt           *time.Time
	// NodeID is the node whose join consumed the approval; "" until then.
	NodeID string
	// Source is the address the deferred join came from (the peer the
	// gateway saw, without its port); "" when unknown.
	Source string
	// EKCert is the standing of a tpm request's EK certificate (R22.1):
	// EKCertAbsent, EKCertUntrusted or EKCertTrusted; "" for other
	// attestors. EKCertSubject and EKCertIssuer are as the machine sent
	// them, verified only when trusted.
	EKCert, EKCertSubject, EKCertIssuer string
	// AKName is the name of the TPM attestation key that certified the
	// node key; nil for other attestors.
	AKName []byte
	// Effect is what approving the request does (R22.2): JoinEffectNew,
	// JoinEffectReclaim or JoinEffectBind, EffectNodeID the node taken
	// ("" for a new node). "" for a request recorded before effects were.
	Effect, EffectNodeID string
	// AcknowledgedNodeID is the node an approval acknowledged it reclaims
	// (DecideJoinRequest); "" when none.
	AcknowledgedNodeID string
}

// Standings of a tpm request's EK certificate (JoinRequest.EKCert).
const (
	EKCertAbsent    = "absent"
	EKCertUntrusted = "untrusted"
	EKCertTrusted   = "trusted"
)

// Effects of approving a join request (JoinRequest.Effect).
const (
	JoinEffectNew     = "new-node"
	JoinEffectReclaim = "reclaim"
	JoinEffectBind    = "bind"
)

const joinRequestCols = `id, tenant_id, pool_id, site_id, attestor, role, machine_key, claims, hardware_key, ek_hash,
	mac, ip, workflow_id, vouched_by, boot_lease_epoch, csr_sha256, state, created_ms, updated_ms,
	decided_ms, decided_by, reason, approved_until_ms, consumed_ms, node_id, source,
	ek_cert, ek_cert_subject, ek_cert_issuer, ak_name, effect, effect_node_id, acknowledged_node_id`

// openStates is the SQL set of open request states.
const openStates = `('pending', 'approved')`

func scanJoinRequest(sc interface{ Scan(...any) error }) (JoinRequest, error) {
	var r JoinRequest
	var claims string
	var created, updated int64
	var decided, until, consumed sql.NullInt64
	if err := sc.Scan(&r.ID, &r.TenantID, &r.PoolID, &r.SiteID, &r.Attestor, &r.Role, &r.MachineKey, &claims, &r.HardwareKey, &r.EKHash,
		&r.MAC, &r.IP, &r.WorkflowID, &r.VouchedBy, &r.BootLeaseEpoch, &r.CSRSHA256, &r.State, &created, &updated,
		&decided, &r.DecidedBy, &r.Reason, &until, &consumed, &r.NodeID, &r.Source,
		&r.EKCert, &r.EKCertSubject, &r.EKCertIssuer, &r.AKName, &r.Effect, &r.EffectNodeID, &r.AcknowledgedNodeID); err != nil {
		return JoinRequest{}, err
	}
	r.Claims = []byte(claims)
	r.CreatedAt, r.UpdatedAt = fromMS(created), fromMS(updated)
	r.DecidedAt, r.ApprovedUntil, r.ConsumedAt = fromNullMS(decided), fromNullMS(until), fromNullMS(consumed)
	return r, nil
}

// claimsText is the stored form of claims: "{}" when there are none.
func claimsText(b []byte) string {
	if len(b) == 0 {
		return "{}"
	}
	return string(b)
}

// OpenJoinRequest reads the open (pending or approved) request of a
// machine; ErrNotFound when it has none.
func (t *Tx) OpenJoinRequest(ctx context.Context, tenantID, machineKey string) (JoinRequest, error) {
	r, err := scanJoinRequest(t.queryRow(ctx, "SELECT "+joinRequestCols+" FROM join_requests WHERE tenant_id = ? AND machine_key = ? AND state IN "+openStates,
		tenantID, machineKey))
	return r, notFound(err)
}

// JoinRequestByCSR reads the newest request, in any state, with this CSR
// hash in the tenant; ErrNotFound when there is none.
func (t *Tx) JoinRequestByCSR(ctx context.Context, tenantID string, csrSHA256 []byte) (JoinRequest, error) {
	r, err := scanJoinRequest(t.queryRow(ctx, "SELECT "+joinRequestCols+" FROM join_requests WHERE tenant_id = ? AND csr_sha256 = ? ORDER BY id DESC LIMIT 1",
		tenantID, csrSHA256))
	return r, notFound(err)
}

// InsertJoinRequest inserts a pending request created at compute_now() (its
// State is ignored). When the machine already has an open request it fails
// with a unique violation (IsUniqueViolation); on PostgreSQL that aborts
// the transaction, so look first (OpenJoinRequest) and let a racing loser
// roll back and retry.
func (t *Tx) InsertJoinRequest(ctx context.Context, r JoinRequest) (JoinRequest, error) {
	row := t.queryRow(ctx, `INSERT INTO join_requests (id, tenant_id, pool_id, site_id, attestor, role, machine_key, claims, hardware_key, ek_hash,
			mac, ip, workflow_id, vouched_by, boot_lease_epoch, csr_sha256, source, ek_cert, ek_cert_subject, ek_cert_issuer, ak_name,
			effect, effect_node_id, state, created_ms, updated_ms)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'pending', compute_now(), compute_now()) RETURNING `+joinRequestCols,
		r.ID, r.TenantID, r.PoolID, r.SiteID, r.Attestor, r.Role, r.MachineKey, claimsText(r.Claims), nullBytes(r.HardwareKey), nullBytes(r.EKHash),
		r.MAC, r.IP, r.WorkflowID, r.VouchedBy, r.BootLeaseEpoch, r.CSRSHA256, r.Source, r.EKCert, r.EKCertSubject, r.EKCertIssuer, nullBytes(r.AKName),
		r.Effect, r.EffectNodeID)
	out, err := scanJoinRequest(row)
	if err != nil {
		return JoinRequest{}, fmt.Errorf("insert join request: %w", err)
	}
	return out, nil
}

// RefreshJoinRequest records a newer attempt of the machine whose open
// request is r.ID: it takes r's pool, site, attestor, role, claims,
// hardware key, EK hash, MAC, IP, workflow id, vouched-by, boot lease epoch,
// CSR hash, source, EK certificate, AK name and effect, and puts the request back to pending, clearing any decision
// (an approval admits the CSR it was given for, not a newer one). It fails
// with ErrNotFound when the request is no longer open.
func (t *Tx) RefreshJoinRequest(ctx context.Context, r JoinRequest) (JoinRequest, error) {
	row := t.queryRow(ctx, `UPDATE join_requests SET pool_id = ?, site_id = ?, attestor = ?, role = ?, claims = ?, hardware_key = ?, ek_hash = ?,
			mac = ?, ip = ?, workflow_id = ?, vouched_by = ?, boot_lease_epoch = ?, csr_sha256 = ?, source = ?,
			ek_cert = ?, ek_cert_subject = ?, ek_cert_issuer = ?, ak_name = ?, effect = ?, effect_node_id = ?,
			state = 'pending', updated_ms = compute_now(),
			decided_ms = NULL, decided_by = '', reason = '', approved_until_ms = NULL, acknowledged_node_id = ''
		WHERE id = ? AND state IN `+openStates+` RETURNING `+joinRequestCols,
		r.PoolID, r.SiteID, r.Attestor, r.Role, claimsText(r.Claims), nullBytes(r.HardwareKey), nullBytes(r.EKHash),
		r.MAC, r.IP, r.WorkflowID, r.VouchedBy, r.BootLeaseEpoch, r.CSRSHA256, r.Source,
		r.EKCert, r.EKCertSubject, r.EKCertIssuer, nullBytes(r.AKName), r.Effect, r.EffectNodeID, r.ID)
	out, err := scanJoinRequest(row)
	return out, notFound(err)
}

// DecideJoinRequest decides a pending request at at: state
// JoinRequestApproved (approvedUntil required: the approval admits one join
// until then) or JoinRequestRejected. ackNodeID is the node an approval
// acknowledged it reclaims ("" for none). It fails with ErrNotFound when
// the request is not pending (absent, or decided already).
func (t *Tx) DecideJoinRequest(ctx context.Context, id, state, decidedBy, reason, ackNodeID string, at time.Time, approvedUntil *time.Time) (JoinRequest, error) {
	var until any
	switch {
	case state == JoinRequestApproved && approvedUntil != nil:
		until = ms(*approvedUntil)
	case state == JoinRequestRejected && approvedUntil == nil:
	default:
		return JoinRequest{}, fmt.Errorf("decide join request: state %q with approved-until %v: want approved with a time or rejected without", state, approvedUntil)
	}
	row := t.queryRow(ctx, `UPDATE join_requests SET state = ?, decided_ms = ?, decided_by = ?, reason = ?, approved_until_ms = ?, updated_ms = ?,
			acknowledged_node_id = ?
		WHERE id = ? AND state = 'pending' RETURNING `+joinRequestCols,
		state, ms(at), decidedBy, reason, until, ms(at), ackNodeID, id)
	out, err := scanJoinRequest(row)
	return out, notFound(err)
}

// ConsumeJoinRequest spends an approval at at for the join that made node
// nodeID: an approved request whose approval lasts past at becomes
// consumed. It fails with ErrNotFound when no row matched (not approved,
// consumed by a racing join, or run out): exactly one consumer wins. Call
// it inside the join's transaction, so the approval is spent only when the
// join lands.
func (t *Tx) ConsumeJoinRequest(ctx context.Context, id, nodeID string, at time.Time) error {
	res, err := t.exec(ctx, `UPDATE join_requests SET state = 'consumed', consumed_ms = ?, node_id = ?, updated_ms = ?
		WHERE id = ? AND state = 'approved' AND approved_until_ms > ? AND consumed_ms IS NULL`,
		ms(at), nodeID, ms(at), id, ms(at))
	if err != nil {
		return fmt.Errorf("consume join request: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return fmt.Errorf("consume join request: %w", err)
	}
	if n != 1 {
		return ErrNotFound
	}
	return nil
}

// ExpireJoinRequest stores that an approval ran out unused: approved
// becomes expired. A request that is not approved is left alone, without
// an error.
func (t *Tx) ExpireJoinRequest(ctx context.Context, id string, at time.Time) error {
	if _, err := t.exec(ctx, "UPDATE join_requests SET state = 'expired', updated_ms = ? WHERE id = ? AND state = 'approved'", ms(at), id); err != nil {
		return fmt.Errorf("expire join request: %w", err)
	}
	return nil
}

// GetJoinRequest reads a request.
func (t *Tx) GetJoinRequest(ctx context.Context, id string) (JoinRequest, error) {
	r, err := scanJoinRequest(t.queryRow(ctx, "SELECT "+joinRequestCols+" FROM join_requests WHERE id = ?", id))
	return r, notFound(err)
}

// ListJoinRequests lists a pool's requests in the tenant in id order after
// `after`, up to limit, in the stored states given (nil: every state).
func (t *Tx) ListJoinRequests(ctx context.Context, tenantID, poolID string, states []string, after string, limit int) ([]JoinRequest, error) {
	q := "SELECT " + joinRequestCols + " FROM join_requests WHERE tenant_id = ? AND pool_id = ?"
	args := []any{tenantID, poolID}
	if states != nil {
		if len(states) == 0 {
			return nil, nil
		}
		q += " AND state IN (?" + strings.Repeat(", ?", len(states)-1) + ")"
		for _, s := range states {
			args = append(args, s)
		}
	}
	q += " AND id > ? ORDER BY id LIMIT ?"
	rows, err := t.query(ctx, q, append(args, after, limit)...)
	if err != nil {
		return nil, fmt.Errorf("list join requests: %w", err)
	}
	defer rows.Close()
	var out []JoinRequest
	for rows.Next() {
		r, err := scanJoinRequest(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// OpenJoinRequestsByHardwareKey lists the open requests of the tenant's
// pool with this hardware key, in id order, up to limit (R22.2: two
// machines with the same claims).
func (t *Tx) OpenJoinRequestsByHardwareKey(ctx context.Context, tenantID, poolID string, hardwareKey []byte, limit int) ([]JoinRequest, error) {
	rows, err := t.query(ctx, "SELECT "+joinRequestCols+" FROM join_requests WHERE tenant_id = ? AND hardware_key = ? AND pool_id = ? AND state IN "+openStates+" ORDER BY id LIMIT ?",
		tenantID, hardwareKey, poolID, limit)
	if err != nil {
		return nil, fmt.Errorf("list join requests by hardware key: %w", err)
	}
	defer rows.Close()
	var out []JoinRequest
	for rows.Next() {
		r, err := scanJoinRequest(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// SiteVouch is a site_vouches row: a site agent's word that it booted the
// machine with this MAC, under a DHCP lease of this epoch (R10.4).
type SiteVouch struct {
	TenantID, SiteID, MAC, IP string
	LeaseEpoch                int64
	// VouchedBy is the site agent's node id.
	VouchedBy, WorkflowID string
	// UpdatedAt is read back (compute_now() of the last change).
	UpdatedAt time.Time
	// BoundNodeID is the node this vouch admitted (BindSiteVouch), read
	// back; "" while it admitted none. A binding made under an older
	// lease epoch does not count: a newer boot of the NIC is a new vouch.
	BoundNodeID string
}

// UpsertSiteVouch records a vouch, replacing the site's vouch for the MAC
// unless the stored one has a higher lease epoch: then nothing changes and
// it reports false.
func (t *Tx) UpsertSiteVouch(ctx context.Context, v SiteVouch) (bool, error) {
	res, err := t.exec(ctx, `INSERT INTO site_vouches (tenant_id, site_id, mac, ip, lease_epoch, vouched_by, workflow_id, updated_ms)
		VALUES (?, ?, ?, ?, ?, ?, ?, compute_now())
		ON CONFLICT (tenant_id, site_id, mac) DO UPDATE SET ip = excluded.ip, lease_epoch = excluded.lease_epoch,
			vouched_by = excluded.vouched_by, workflow_id = excluded.workflow_id, updated_ms = excluded.updated_ms
		WHERE excluded.lease_epoch >= site_vouches.lease_epoch`,
		v.TenantID, v.SiteID, v.MAC, v.IP, v.LeaseEpoch, v.VouchedBy, v.WorkflowID)
	if err != nil {
		return false, fmt.Errorf("upsert site vouch: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("upsert site vouch: %w", err)
	}
	return n == 1, nil
}

// SiteVouchesByMAC lists every site's vouch for the MAC in the tenant, in
// site order.
func (t *Tx) SiteVouchesByMAC(ctx context.Context, tenantID, mac string) ([]SiteVouch, error) {
	rows, err := t.query(ctx, `SELECT tenant_id, site_id, mac, ip, lease_epoch, vouched_by, workflow_id, updated_ms,
			CASE WHEN bound_lease_epoch = lease_epoch THEN bound_node_id ELSE '' END FROM site_vouches
		WHERE tenant_id = ? AND mac = ? ORDER BY site_id`, tenantID, mac)
	if err != nil {
		return nil, fmt.Errorf("find site vouches: %w", err)
	}
	defer rows.Close()
	var out []SiteVouch
	for rows.Next() {
		var v SiteVouch
		var updated int64
		var bound sql.NullString
		if err := rows.Scan(&v.TenantID, &v.SiteID, &v.MAC, &v.IP, &v.LeaseEpoch, &v.VouchedBy, &v.WorkflowID, &updated, &bound); err != nil {
			return nil, err
		}
		v.BoundNodeID = bound.String
		v.UpdatedAt = fromMS(updated)
		out = append(out, v)
	}
	return out, rows.Err()
}

// BindSiteVouch binds the site's vouch for the MAC, at this lease epoch, to
// the node a join admitted on it (R15.3: a vouch admits only the machine it
// vouched for). The first admission binds it and the same node again keeps
// it; it reports false, changing nothing, when the vouch is bound to
// another node for this epoch or is no longer at this epoch. Run inside the
// admission transaction: on PostgreSQL the row stays locked until the
// commit, so of two joins on one vouch the second waits and then finds it
// bound.
func (t *Tx) BindSiteVouch(ctx context.Context, tenantID, siteID, mac string, leaseEpoch int64, nodeID string) (bool, error) {
	res, err := t.exec(ctx, `UPDATE site_vouches SET bound_node_id = ?, bound_lease_epoch = lease_epoch
		WHERE tenant_id = ? AND site_id = ? AND mac = ? AND lease_epoch = ?
			AND (bound_lease_epoch IS NULL OR bound_lease_epoch <> lease_epoch OR bound_node_id = ?)`,
		nodeID, tenantID, siteID, mac, leaseEpoch, nodeID)
	if err != nil {
		return false, fmt.Errorf("bind site vouch: %w", err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return false, fmt.Errorf("bind site vouch: %w", err)
	}
	return n == 1, nil
}

// CountOpenJoinRequests counts the open (pending and approved) requests of
// every tenant by stored state, for metrics; it reads the open-request
// index only.
func (t *Tx) CountOpenJoinRequests(ctx context.Context) (map[string]int, error) {
	rows, err := t.query(ctx, "SELECT state, COUNT(*) FROM join_requests WHERE state IN "+openStates+" GROUP BY state")
	if err != nil {
		return nil, fmt.Errorf("count join requests: %w", err)
	}
	defer rows.Close()
	out := map[string]int{JoinRequestPending: 0, JoinRequestApproved: 0}
	for rows.Next() {
		var state string
		var n int
		if err := rows.Scan(&state, &n); err != nil {
			return nil, err
		}
		out[state] = n
	}
	return out, rows.Err()
}
