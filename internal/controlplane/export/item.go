package export

import (
	"encoding/json"
	"fmt"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/better-compute/better-compute/internal/controlplane/api"
	"github.com/better-compute/better-compute/internal/controlplane/store"
)

// Item is one exported row, a line of the file sink and of a webhook batch.
// ID is the idempotency key: the id the API lists the row under.
type Item struct {
	ID     string `json:"id"`
	Kind   string `json:"kind"`   // "event" or "audit"
	Type   string `json:"type"`   // an event's type, an audit row's action
	Tenant string `json:"tenant"` // tenant id
	Time   string `json:"time"`   // RFC 3339, UTC
	// Event or Audit is the row as ListEvents or ListAudit answers it.
	Event json.RawMessage `json:"event,omitempty"`
	Audit json.RawMessage `json:"audit,omitempty"`
}

// The kinds of Item, also the names of SinkConfig.Kinds (plural there).
const (
	KindEvent = "event"
	KindAudit = "audit"
)

// items turns a batch read after pos into Items, and returns the position
// after it.
func (e *Exporter) items(pos store.ExportPosition, evs []store.Event, aus []store.ExportAudit) ([]Item, store.ExportPosition, error) {
	out := make([]Item, 0, len(evs)+len(aus))
	for _, ev := range evs {
		pb := api.EventPB(e.cfg.Codec, ev)
		b, err := protojson.Marshal(pb)
		if err != nil {
			return nil, pos, fmt.Errorf("encode event: %w", err)
		}
		out = append(out, Item{ID: pb.Id, Kind: KindEvent, Type: ev.Type, Tenant: ev.TenantID, Time: rfc3339(ev.CreatedAt), Event: b})
		pos.EventOrder, pos.EventID = ev.TxOrder, ev.ID
	}
	for _, a := range aus {
		pb := api.AuditPB(e.cfg.Codec, a.AuditEntry)
		b, err := protojson.Marshal(pb)
		if err != nil {
			return nil, pos, fmt.Errorf("encode audit row: %w", err)
		}
		out = append(out, Item{ID: pb.Id, Kind: KindAudit, Type: a.Action, Tenant: a.TenantID, Time: rfc3339(a.CreatedAt), Audit: b})
		pos.AuditOrder, pos.AuditID = a.Order, a.ID
	}
	return out, pos, nil
}

func rfc3339(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }

// jsonLines encodes items one JSON object a line.
func jsonLines(items []Item) ([]byte, error) {
	var out []byte
	for _, it := range items {
		b, err := json.Marshal(it)
		if err != nil {
			return nil, err
		}
		out = append(append(out, b...), '\n')
	}
	return out, nil
}
