package api_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/better-compute/better-compute/internal/controlplane/apitest"
)

const createPath = "/api/compute/bettercompute.v1.JoinTokenService/CreateJoinToken"

// post sends body as Connect JSON to the create procedure, the way curl
// would, and returns the status and the decoded answer.
func post(t *testing.T, e *apitest.Env, contentType, auth string, body io.Reader) (int, map[string]any) {
	t.Helper()
	return postTo(t, e, createPath, contentType, auth, body)
}

// postTo is post to the procedure at path.
func postTo(t *testing.T, e *apitest.Env, path, contentType, auth string, body io.Reader) (int, map[string]any) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, e.URL+path, body)
	mustOK(t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if auth != "" {
		req.Header.Set("Authorization", "Bearer "+auth)
	}
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		// The server may close the connection on an oversized body before
		// reading it all; the request still failed, which is the point.
		return 0, nil
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(res.Body, 1<<20))
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	return res.StatusCode, m
}

// R2.2, R14.1 (nothing half-written): malformed requests through raw HTTP
// are refused with 4xx before anything is written.
func TestCreateJoinTokenRawHTTP(t *testing.T) {
	apitest.Each(t, apitest.Options{NoJoin: true}, func(t *testing.T, e *apitest.Env) {
		w := newWorld(t, e)
		ok := fmt.Sprintf(`{"tenantId":%q,"poolId":%q,"ttlSeconds":3600`, w.root, w.pool.Id)

		// The well-formed call works, with the record's zero values written
		// out.
		status, m := post(t, e, "application/json", e.AdminKey, strings.NewReader(ok+`}`))
		if status != 200 || !strings.HasPrefix(fmt.Sprint(m["token"]), "bcjt_jt_") || m["allowReclaim"] != false || m["usesLeft"] != float64(1) {
			t.Fatalf("valid create: %d %v", status, m)
		}

		snap := settle(t, w, w.root, e.Admin, w.pool.Id)
		huge := strings.Repeat("k", 2<<20)
		cases := []struct {
			name, contentType, auth, body string
			status                        int // 0: any 4xx
		}{
			{"unknown field", "application/json", e.AdminKey, ok + `,"bogus":1}`, 400},
			{"unknown nested field", "application/json", e.AdminKey, ok + `,"expect":{"serial":"SN-1","colour":"red"}}`, 400},
			{"ttl as a string of letters", "application/json", e.AdminKey, fmt.Sprintf(`{"tenantId":%q,"poolId":%q,"ttlSeconds":"abc"}`, w.root, w.pool.Id), 400},
			{"maxUses fractional", "application/json", e.AdminKey, ok + `,"maxUses":1.5}`, 400},
			{"maxUses beyond int32", "application/json", e.AdminKey, ok + `,"maxUses":4294967296}`, 400},
			{"expect as a string", "application/json", e.AdminKey, ok + `,"expect":"SN-1"}`, 400},
			{"allowReclaim as a string", "application/json", e.AdminKey, ok + `,"allowReclaim":"yes"}`, 400},
			{"not JSON", "application/json", e.AdminKey, `tenantId=` + w.root, 400},
			{"truncated JSON", "application/json", e.AdminKey, ok, 400},
			{"JSON array", "application/json", e.AdminKey, `[` + ok + `}]`, 400},
			{"empty body", "application/json", e.AdminKey, ``, 400},
			{"oversized body", "application/json", e.AdminKey, ok + `,"idempotencyKey":"` + huge + `"}`, 0},
			{"no credentials", "application/json", "", ok + `}`, 401},
			{"wrong content type", "text/plain", e.AdminKey, ok + `}`, 415},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				status, m := post(t, e, c.contentType, c.auth, strings.NewReader(c.body))
				if status == 0 && c.status == 0 {
					return // connection closed on the oversized body
				}
				if status < 400 || status > 499 || (c.status != 0 && status != c.status) {
					t.Fatalf("status %d (want %d), answer %v", status, c.status, m)
				}
				wire := map[int]string{400: "invalid_argument", 401: "unauthenticated", 429: "resource_exhausted"}[status]
				if status != 415 && (m["code"] == nil || (wire != "" && m["code"] != wire)) {
					t.Fatalf("status %d with Connect code %v, want %q: %v", status, m["code"], wire, m)
				}
			})
		}
		// GET is not a way in either.
		res, err := http.Get(e.URL + createPath)
		mustOK(t, err)
		res.Body.Close()
		if res.StatusCode < 400 || res.StatusCode > 499 {
			t.Fatalf("GET: %d", res.StatusCode)
		}
		// Nothing was written: no token row, no event, no audit row.
		snap.unchanged(t, w, w.root, e.Admin, w.pool.Id)
	})
}
