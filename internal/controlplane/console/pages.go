package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"sort"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	bcv1 "github.com/better-compute/better-compute/gen/bettercompute/v1"
	"github.com/better-compute/better-compute/internal/shared/errs"
)

// funcs are the templates' helpers.
var funcs = template.FuncMap{
	"ts": func(t *timestamppb.Timestamp) string {
		if t == nil || (t.Seconds == 0 && t.Nanos == 0) {
			return "—"
		}
		return t.AsTime().UTC().Format(time.RFC3339)
	},
	"fields": fields,
	// title is a page's name as its heading says it.
	"title": func(name string) string {
		return map[string]string{"join-requests": "Join requests", "tokens": "Join tokens", "nodes": "Nodes", "events": "Events"}[name]
	},
	// serials and macs read a node's claims (hwid.Claims as JSON).
	"serials": func(c *structpb.Struct) []string {
		var out []string
		for _, k := range []string{"productSerial", "boardSerial", "chassisSerial"} {
			if v := c.GetFields()[k].GetStringValue(); v != "" {
				out = append(out, v)
			}
		}
		return out
	},
	"macs": func(c *structpb.Struct) []string {
		var out []string
		for _, v := range c.GetFields()["macs"].GetListValue().GetValues() {
			out = append(out, v.GetStringValue())
		}
		return out
	},
	"join": func(s []string) string {
		if len(s) == 0 {
			return "—"
		}
		return strings.Join(s, ", ")
	},
	"short": func(s string) string {
		if len(s) > 16 {
			return s[:16] + "…"
		}
		return s
	},
}

// field is one key of a claims or event data object, its value as text.
type field struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

// fields turns claims or an event's data into a readable list, one key a
// line in key order: strings as they are, lists joined with ", ", objects
// as key=value pairs, whole numbers without a decimal point.
func fields(s *structpb.Struct) []field {
	keys := make([]string, 0, len(s.GetFields()))
	for k := range s.GetFields() {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	out := make([]field, 0, len(keys))
	for _, k := range keys {
		out = append(out, field{Key: k, Value: valueText(s.Fields[k])})
	}
	return out
}

func valueText(v *structpb.Value) string {
	switch x := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return x.StringValue
	case *structpb.Value_NumberValue:
		return strconv.FormatFloat(x.NumberValue, 'f', -1, 64)
	case *structpb.Value_BoolValue:
		return strconv.FormatBool(x.BoolValue)
	case *structpb.Value_ListValue:
		var parts []string
		for _, e := range x.ListValue.GetValues() {
			parts = append(parts, valueText(e))
		}
		return strings.Join(parts, ", ")
	case *structpb.Value_StructValue:
		var parts []string
		for _, f := range fields(x.StructValue) {
			parts = append(parts, f.Key+"="+f.Value)
		}
		return strings.Join(parts, ", ")
	}
	return ""
}

// page is what every signed-in page shows: the navigation, the tenant and
// pool chooser and an error or notice.
type page struct {
	Prefix, CSRF, Name string
	Tenant, Pool       string
	Tenants            []*bcv1.Tenant
	Pools              []*bcv1.Pool
	Error, Notice      string
	Data               any
}

func (p *page) fail(err error) {
	if err != nil && p.Error == "" {
		p.Error = errText(err)
	}
}

// Query is the tenant and pool query of the page's links.
func (p *page) Query() template.URL {
	return template.URL("tenant=" + url.QueryEscape(p.Tenant) + "&pool=" + url.QueryEscape(p.Pool))
}

func req[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

func (c *Console) listTenants(ctx context.Context, key string) ([]*bcv1.Tenant, error) {
	res, err := c.api(key).Tenants.ListTenants(ctx, req(&bcv1.ListTenantsRequest{PageSize: 200}))
	if err != nil {
		return nil, err
	}
	return res.Msg.Items, nil
}

// newPage lists the tenants and pools the key sees (through the API) and
// settles the tenant and pool: the query's, else the first listed.
func (c *Console) newPage(r *http.Request, s *session, name string) *page {
	p := &page{Prefix: c.prefix, CSRF: s.csrf, Name: name, Tenant: r.FormValue("tenant"), Pool: r.FormValue("pool")}
	ts, err := c.listTenants(r.Context(), s.key)
	p.fail(err)
	p.Tenants = ts
	if p.Tenant == "" && len(ts) > 0 {
		p.Tenant = ts[0].Id
	}
	if p.Tenant == "" {
		return p
	}
	res, err := c.api(s.key).Pools.ListPools(r.Context(), req(&bcv1.ListPoolsRequest{TenantId: p.Tenant, PageSize: 200}))
	p.fail(err)
	if err == nil {
		p.Pools = res.Msg.Items
		if p.Pool == "" && len(p.Pools) > 0 {
			p.Pool = p.Pools[0].Id
		}
	}
	return p
}

// back redirects to a page of the same tenant and pool; the notice and the
// failure are kept in the session for that page to show once (never in the
// URL, where a crafted link could put words on the page).
func (c *Console) back(w http.ResponseWriter, r *http.Request, s *session, path, notice, failure string) {
	c.mu.Lock()
	s.notice, s.failure = notice, failure
	c.mu.Unlock()
	q := url.Values{"tenant": {r.PostForm.Get("tenant")}, "pool": {r.PostForm.Get("pool")}}
	http.Redirect(w, r, c.prefix+path+"?"+q.Encode(), http.StatusSeeOther)
}

func (c *Console) show(w http.ResponseWriter, r *http.Request, s *session, p *page) {
	c.mu.Lock()
	p.Notice = s.notice
	if p.Error == "" {
		p.Error = s.failure
	}
	s.notice, s.failure = "", ""
	c.mu.Unlock()
	c.render(w, http.StatusOK, p.Name, p)
}

func (c *Console) joinRequests(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.newPage(r, s, "join-requests")
	state := r.FormValue("state")
	var items []*bcv1.JoinRequest
	if p.Pool != "" {
		m := &bcv1.ListJoinRequestsRequest{TenantId: p.Tenant, PoolId: p.Pool, PageSize: 200}
		if state != "" {
			m.State = []string{state}
		}
		res, err := c.api(s.key).JoinRequests.ListJoinRequests(r.Context(), req(m))
		p.fail(err)
		if err == nil {
			items = res.Msg.Items
		}
	}
	p.Data = map[string]any{"Items": items, "State": state}
	c.show(w, r, s, p)
}

// decide approves or rejects the selected join requests, one API call each.
func (c *Console) decide(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	ids := f["id"]
	if len(ids) == 0 {
		c.back(w, r, s, "/join-requests", "", "select at least one join request")
		return
	}
	tenant, pool, reason := f.Get("tenant"), f.Get("pool"), f.Get("reason")
	cl := c.api(s.key)
	done, failed := 0, []string{}
	for _, id := range ids {
		var err error
		switch f.Get("action") {
		case "approve":
			ttl, _ := strconv.Atoi(f.Get("ttl"))
			// R22.2: the approval is bound to the version the page showed,
			// and a reclaim to the takeover its row confirmed.
			_, err = cl.JoinRequests.ApproveJoinRequest(r.Context(), req(&bcv1.ApproveJoinRequestRequest{TenantId: tenant, PoolId: pool, RequestId: id,
				TtlSeconds: int32(ttl), Reason: reason, Version: f.Get("version-" + id), AcknowledgeReclaimNodeId: f.Get("reclaim-" + id)}))
		case "reject":
			_, err = cl.JoinRequests.RejectJoinRequest(r.Context(), req(&bcv1.RejectJoinRequestRequest{TenantId: tenant, PoolId: pool, RequestId: id, Reason: reason}))
		default:
			err = errs.Invalid("action", "action must be approve or reject")
		}
		if err != nil {
			failed = append(failed, id+": "+errText(err))
			continue
		}
		done++
	}
	verb := map[string]string{"approve": "approved", "reject": "rejected"}[f.Get("action")]
	c.back(w, r, s, "/join-requests", fmt.Sprintf("%d %s", done, verb), strings.Join(failed, "; "))
}

func (c *Console) tokens(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.newPage(r, s, "tokens")
	c.listTokens(r, s, p, nil)
	c.show(w, r, s, p)
}

func (c *Console) listTokens(r *http.Request, s *session, p *page, created *bcv1.JoinToken) {
	var items []*bcv1.JoinToken
	if p.Pool != "" {
		res, err := c.api(s.key).JoinTokens.ListJoinTokens(r.Context(), req(&bcv1.ListJoinTokensRequest{TenantId: p.Tenant, PoolId: p.Pool,
			IncludeInactive: r.FormValue("inactive") != "", PageSize: 200}))
		p.fail(err)
		if err == nil {
			items = res.Msg.Items
		}
	}
	// Idem is the create form's idempotency key: submitting the same form
	// again (a reload after the POST) names the token it made, not a second.
	d := map[string]any{"Items": items, "Inactive": r.FormValue("inactive") != "", "Idem": randomID()}
	if created != nil {
		d["Created"] = created
		// The token never goes on a command line (shell history, ps):
		// it is pasted into a file bcd reads and deletes.
		d["Install"] = "umask 077 && cat > ./join-token    # paste the token above, then Enter and Ctrl-D\nsudo bcd join --token-file ./join-token"
		// Where the page starts watching the tenant's node.joined events
		// for this token: the end of the stream now, before anyone has
		// the secret.
		_, cursor, failure := c.joinedEvents(r, s, p.Tenant, "")
		p.fail(errorText(failure))
		d["Cursor"] = cursor
	}
	p.Data = d
}

// createToken mints a token and shows its secret once, with the command
// that joins a machine; the page then waits for that join (console.js).
func (c *Console) createToken(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	ttl, _ := strconv.Atoi(f.Get("ttl"))
	uses, _ := strconv.Atoi(f.Get("uses"))
	res, err := c.api(s.key).JoinTokens.CreateJoinToken(r.Context(), req(&bcv1.CreateJoinTokenRequest{TenantId: f.Get("tenant"), PoolId: f.Get("pool"),
		TtlSeconds: int32(ttl), MaxUses: int32(uses), IdempotencyKey: f.Get("idem")}))
	if err != nil {
		c.back(w, r, s, "/tokens", "", errText(err))
		return
	}
	if res.Msg.Token == "" {
		// The API answers a repeat with the token it made the first time,
		// without its secret.
		c.back(w, r, s, "/tokens", "", "this form was already sent: it created "+res.Msg.Id+
			", whose secret was shown once; revoke it and create another if it was not copied")
		return
	}
	p := c.newPage(r, s, "tokens")
	c.listTokens(r, s, p, res.Msg)
	c.render(w, http.StatusOK, "tokens", p)
}

func (c *Console) revokeToken(w http.ResponseWriter, r *http.Request, s *session) {
	f := r.PostForm
	_, err := c.api(s.key).JoinTokens.RevokeJoinToken(r.Context(), req(&bcv1.RevokeJoinTokenRequest{TenantId: f.Get("tenant"), PoolId: f.Get("pool"), TokenId: f.Get("token")}))
	if err != nil {
		c.back(w, r, s, "/tokens", "", errText(err))
		return
	}
	c.back(w, r, s, "/tokens", "revoked "+f.Get("token"), "")
}

// errorText is a failure string as an error (nil when empty).
func errorText(s string) error {
	if s == "" {
		return nil
	}
	return errors.New(s)
}

// joinedEvents reads the tenant's node.joined events after cursor (up to
// 50 pages) and returns them with the cursor after the last.
func (c *Console) joinedEvents(r *http.Request, s *session, tenant, cursor string) ([]*bcv1.Event, string, string) {
	var out []*bcv1.Event
	for range 50 {
		res, err := c.api(s.key).Events.ListEvents(r.Context(), req(&bcv1.ListEventsRequest{TenantId: tenant, Cursor: cursor, TypePrefix: "node.joined", Limit: 200}))
		if err != nil {
			return nil, cursor, errText(err)
		}
		out = append(out, res.Msg.Events...)
		if res.Msg.NextCursor != "" {
			cursor = res.Msg.NextCursor
		}
		if len(res.Msg.Events) < 200 {
			break
		}
	}
	return out, cursor, ""
}

// joinedJSON is what the token page polls to show the machine that joined
// with the new token: the nodes whose node.joined event (after the page's
// cursor) names that token, whatever else joined the pool meanwhile, and
// the cursor to ask from next.
func (c *Console) joinedJSON(w http.ResponseWriter, r *http.Request, s *session) {
	type joined struct {
		ID       string `json:"id"`
		Hostname string `json:"hostname"`
		State    string `json:"state"`
	}
	out := struct {
		Nodes  []joined `json:"nodes"`
		Cursor string   `json:"cursor"`
		Error  string   `json:"error,omitempty"`
	}{Nodes: []joined{}}
	tenant, token := r.FormValue("tenant"), r.FormValue("token")
	evs, cursor, failure := c.joinedEvents(r, s, tenant, r.FormValue("cursor"))
	out.Cursor, out.Error = cursor, failure
	for _, e := range evs {
		f := e.Data.GetFields()
		if token == "" || f["joinTokenId"].GetStringValue() != token {
			continue
		}
		n := joined{ID: e.Subject, Hostname: f["hostname"].GetStringValue()}
		if g, err := c.api(s.key).Nodes.GetNode(r.Context(), req(&bcv1.GetNodeRequest{TenantId: tenant, NodeId: e.Subject})); err == nil {
			n.State = g.Msg.State
		}
		out.Nodes = append(out.Nodes, n)
	}
	writeJSON(w, out)
}

func (c *Console) nodes(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.newPage(r, s, "nodes")
	var items []*bcv1.Node
	if p.Tenant != "" {
		cl := c.api(s.key)
		res, err := cl.Nodes.ListNodes(r.Context(), req(&bcv1.ListNodesRequest{TenantId: p.Tenant, PoolId: p.Pool, PageSize: 100}))
		p.fail(err)
		if err == nil {
			// The list leaves certificates out; GetNode has them.
			for _, n := range res.Msg.Items {
				if g, err := cl.Nodes.GetNode(r.Context(), req(&bcv1.GetNodeRequest{TenantId: p.Tenant, NodeId: n.Id})); err == nil {
					n = g.Msg
				}
				items = append(items, n)
			}
		}
	}
	p.Data = map[string]any{"Items": items}
	c.show(w, r, s, p)
}

func (c *Console) events(w http.ResponseWriter, r *http.Request, s *session) {
	p := c.newPage(r, s, "events")
	var items []*bcv1.Event
	next := ""
	if p.Tenant != "" {
		items, next, p.Error = c.listEvents(r, s, p.Tenant, "")
	}
	p.Data = map[string]any{"Items": items, "Cursor": next}
	c.show(w, r, s, p)
}

// listEvents reads the tenant's events after cursor, newest first. With
// no cursor it reads the stream to its end (at most 50 pages) and keeps the
// last 50: the recent events.
func (c *Console) listEvents(r *http.Request, s *session, tenant, cursor string) ([]*bcv1.Event, string, string) {
	cl := c.api(s.key)
	var items []*bcv1.Event
	for range 50 {
		res, err := cl.Events.ListEvents(r.Context(), req(&bcv1.ListEventsRequest{TenantId: tenant, Cursor: cursor, Limit: 200}))
		if err != nil {
			return nil, cursor, errText(err)
		}
		items = append(items, res.Msg.Events...)
		if res.Msg.NextCursor != "" {
			cursor = res.Msg.NextCursor
		}
		if len(res.Msg.Events) < 200 {
			break
		}
	}
	if len(items) > 50 {
		items = items[len(items)-50:]
	}
	for i, j := 0, len(items)-1; i < j; i, j = i+1, j-1 {
		items[i], items[j] = items[j], items[i]
	}
	return items, cursor, ""
}

// eventsJSON is what the events page polls: the events after a cursor.
func (c *Console) eventsJSON(w http.ResponseWriter, r *http.Request, s *session) {
	type event struct {
		Time, Type, Subject string
		Data                []field
	}
	items, next, failure := c.listEvents(r, s, r.FormValue("tenant"), r.FormValue("cursor"))
	out := struct {
		Events []event `json:"events"`
		Cursor string  `json:"cursor"`
		Error  string  `json:"error,omitempty"`
	}{Events: []event{}, Cursor: next, Error: failure}
	for _, e := range items {
		out.Events = append(out.Events, event{Time: funcs["ts"].(func(*timestamppb.Timestamp) string)(e.Time), Type: e.Type, Subject: e.Subject,
			Data: fields(e.Data)})
	}
	writeJSON(w, out)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
