// Package events owns the durable, per-tenant event stream and the audit log.
// Both are written inside the transaction of the change they describe (so a
// rolled-back change leaves neither), and read back with a cursor. A Hub wakes
// in-process long-poll readers once a transaction's events can be read;
// readers on other replicas fall back to polling.
//
// A cursor never skips or repeats an event, and no other transaction can
// hold a tenant's stream back: on SQLite the single writer commits events
// in id order; on PostgreSQL an event is written without a position and the
// store's sequencer numbers it after it committed (internal/store,
// sequencer.go, says why this design and not a cluster-wide snapshot
// horizon or a per-tenant counter row). The Hub is woken after that
// numbering, so a woken reader finds the event.
//
// Importers: domain packages that publish (tenancy, jointoken, join, nodes,
// session, commands, controller) and the API that reads.
package events

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	"github.com/better-compute/better-compute/internal/store"
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
type Hub struct {
	mu sync.Mutex
	ch chan struct{}
}

// NewHub returns a Hub.
func NewHub() *Hub { return &Hub{ch: make(chan struct{})} }

// Wait returns a channel closed at the next commit that published events.
func (h *Hub) Wait() <-chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ch
}

func (h *Hub) wake() {
	h.mu.Lock()
	close(h.ch)
	h.ch = make(chan struct{})
	h.mu.Unlock()
}

// Publish appends e to its tenant's stream inside tx. A nil hub is allowed.
func Publish(ctx context.Context, tx *store.Tx, hub *Hub, e Event) error {
	data, err := marshal(e.Data)
	if err != nil {
		return fmt.Errorf("publish %s: %w", e.Type, err)
	}
	if err := tx.InsertEvent(ctx, e.TenantID, e.Type, e.Subject, data); err != nil {
		return err
	}
	if hub != nil {
		// Not AfterCommit: on PostgreSQL a committed event is readable
		// only once the sequencer numbered it, and a reader woken before
		// that would find nothing and sleep until its next poll.
		tx.AfterEventsVisible(hub.wake)
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
	data, err := marshal(a.Data)
	if err != nil {
		return fmt.Errorf("audit %s: %w", a.Action, err)
	}
	return tx.InsertAudit(ctx, store.AuditEntry{TenantID: a.TenantID, Actor: a.Actor, Action: a.Action, Resource: a.Resource, Data: data})
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
