// Package events owns the durable, per-tenant event stream and the audit log.
// Both are written inside the transaction of the change they describe (so a
// rolled-back change leaves neither), and read back with a cursor. A Hub wakes
// in-process long-poll readers once a transaction's events can be read;
// readers on other replicas fall back to polling.
//
// A cursor never skips or repeats an event, and no other transaction can
// hold a tenant's stream back: on SQLite the single writer commits events
// in id order; on PostgreSQL an event is written without a position and the
// store's sequencer numbers it after it committed (internal/controlplane/store,
// sequencer.go, says why this design and not a cluster-wide snapshot
// horizon or a per-tenant counter row). The Hub is woken after that
// numbering, so a woken reader finds the event.
//
// What a tenant sees of positions reveals nothing of other tenants (R14.3):
// ids and cursors are positions sealed for the tenant (cursor.go says how,
// why not per-tenant counters, and what happens to the decimal cursors of
// earlier versions), and a tenant's long-poll reader is woken only by that
// tenant's events (Hub.WaitTenant).
//
// Importers: domain packages that publish (tenancy, jointoken, join, nodes,
// session, commands, controller) and the API that reads.
package events

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// Event is one entry of a tenant's stream.
type Event struct {
	TenantID string
	Type     string // e.g. security.join-token.created
	Subject  string // the resource it is about, e.g. jt_…
	Data     any    // marshalled as JSON; a json.RawMessage is taken as encoded
}

// Hub wakes waiting readers after events commit. The zero value is not
// usable; use NewHub.
//
// SECURITY: a tenant's reader waits with WaitTenant and is woken only by
// its own tenant's events (R14.3). Were it woken by every commit, each
// wake would make it read again, and the moments it reads (and, near its
// deadline, when it answers) would follow other tenants' joins. Wait, woken
// by any tenant's events, is for in-process consumers that serve every
// tenant (the controller), never for an answer to a tenant.
type Hub struct {
	mu      sync.Mutex
	all     chan struct{}
	tenants map[string]*tenantWait
}

// tenantWait is the channel a tenant's readers wait on and how many wait.
type tenantWait struct {
	ch chan struct{}
	n  int
}

// NewHub returns a Hub.
func NewHub() *Hub { return &Hub{all: make(chan struct{}), tenants: map[string]*tenantWait{}} }

// Wait returns a channel closed at the next commit that published events,
// of any tenant.
func (h *Hub) Wait() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.all
}

// WaitTenant returns a channel closed once an event of the tenant committed
// after the call can be read, and a release the caller must call when it
// stops waiting (it frees the channel when nobody else waits on it).
func (h *Hub) WaitTenant(tenantID string) (<-chan struct{}, func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	w := h.tenants[tenantID]
	if w == nil {
		w = &tenantWait{ch: make(chan struct{})}
		h.tenants[tenantID] = w
	}
	w.n++
	var once sync.Once
	return w.ch, func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			w.n--
			if w.n == 0 && h.tenants[tenantID] == w {
				delete(h.tenants, tenantID)
			}
		})
	}
}

// Waiting reports how many of the tenant's readers wait on the hub, so a
// test can publish once a long poll waits instead of after a sleep.
func (h *Hub) Waiting(tenantID string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	if w := h.tenants[tenantID]; w != nil {
		return w.n
	}
	return 0
}

// wake wakes the tenant's readers and every Wait.
func (h *Hub) wake(tenantID string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.all)
	h.all = make(chan struct{})
	if w := h.tenants[tenantID]; w != nil {
		close(w.ch)
		delete(h.tenants, tenantID)
	}
}

// Publish appends e to its tenant's stream inside tx. A nil hub is allowed.
func Publish(ctx context.Context, tx *store.Tx, hub *Hub, e Event) error {
	return PublishAll(ctx, tx, hub, e)
}

// PublishAll appends es to their tenants' streams inside tx, in the order
// given, as Publish does for each, with as few statements as the store
// can: a change that announces several facts at once (a join's
// node.joined and node.adopted) pays for one insert, not one per event.
func PublishAll(ctx context.Context, tx *store.Tx, hub *Hub, es ...Event) error {
	rows := make([]store.EventRow, len(es))
	for i, e := range es {
		data, err := marshal(e.Data)
		if err != nil {
			return fmt.Errorf("publish %s: %w", e.Type, err)
		}
		rows[i] = store.EventRow{TenantID: e.TenantID, Type: e.Type, Subject: e.Subject, Data: data}
	}
	if err := tx.InsertEvents(ctx, rows...); err != nil {
		return err
	}
	if hub != nil {
		// Not AfterCommit: on PostgreSQL a committed event is readable
		// only once the sequencer numbered it, and a reader woken before
		// that would find nothing and sleep until its next poll.
		for i, e := range es {
			if i > 0 && es[i-1].TenantID == e.TenantID {
				continue // woken already
			}
			tenant := e.TenantID
			tx.AfterEventsVisible(func() { hub.wake(tenant) })
		}
	}
	return nil
}

// Entry is one audit row: who did what to which resource.
type Entry struct {
	TenantID string
	Actor    string // principal id, node id or "system"
	Action   string // e.g. join-token.created
	Resource string // e.g. compute-pool/pool_…
	Data     any
}

// Audit writes an audit row inside tx.
func Audit(ctx context.Context, tx *store.Tx, a Entry) error {
	return AuditAll(ctx, tx, a)
}

// AuditAll writes audit rows inside tx, in the order given, with as few
// statements as the store can (see PublishAll).
func AuditAll(ctx context.Context, tx *store.Tx, as ...Entry) error {
	rows := make([]store.AuditEntry, len(as))
	for i, a := range as {
		data, err := marshal(a.Data)
		if err != nil {
			return fmt.Errorf("audit %s: %w", a.Action, err)
		}
		rows[i] = store.AuditEntry{TenantID: a.TenantID, Actor: a.Actor, Action: a.Action, Resource: a.Resource, Data: data}
	}
	return tx.InsertAudits(ctx, rows...)
}

func marshal(v any) ([]byte, error) {
	switch v := v.(type) {
	case nil:
		return []byte("{}"), nil
	case json.RawMessage:
		// Already encoded by the caller (json.Marshal), typically once
		// for an event and its audit row: json.Marshal would only scan
		// and copy it again.
		return v, nil
	}
	return json.Marshal(v)
}
