package join

import (
	"encoding/json"
	"testing"
)

// TestJoinedDataEncodesAsTheMap: the node.joined event and audit data keep
// the bytes they had as a map (sorted keys), optional keys included or not.
func TestJoinedDataEncodesAsTheMap(t *testing.T) {
	for _, full := range []bool{false, true} {
		d := joinedData{NodeID: "node_1", PoolID: "pool_1", SiteID: "site_1", Role: "node", Attestor: "join-token", Reclaim: full,
			HardwareKeyTrusted: true, CertSerial: "0a0b", NodeKey: "unattested", IdentityGeneration: 3, JoinTokenID: "jt_1",
			Hostname: "h\"<1>", Peer: "192.0.2.1:5"}
		m := map[string]any{
			"nodeId": d.NodeID, "poolId": d.PoolID, "siteId": d.SiteID, "role": d.Role, "attestor": d.Attestor, "reclaim": d.Reclaim,
			"hardwareKeyTrusted": d.HardwareKeyTrusted, "certSerial": d.CertSerial, "nodeKey": d.NodeKey, "identityGeneration": d.IdentityGeneration,
			"joinTokenId": d.JoinTokenID, "hostname": d.Hostname, "peer": d.Peer,
		}
		if full {
			d.JoinRequestID, d.MadeAhead, d.Rejoin = "jreq_1", true, true
			m["joinRequestId"], m["madeAhead"], m["rejoin"] = d.JoinRequestID, true, true
		}
		got, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(m)
		if string(got) != string(want) {
			t.Errorf("joinedData encodes as\n%s\nthe map as\n%s", got, want)
		}
	}
}

// TestRenewedDataEncodesAsTheMap: likewise for node.certificate-renewed.
func TestRenewedDataEncodesAsTheMap(t *testing.T) {
	d := renewedData{NodeID: "node_1", SiteID: "site_1", Role: "node", CertSerial: "0a", PreviousSerial: "0b",
		IdentityGeneration: 2, NotAfter: "2026-12-01T00:00:00Z", Peer: "192.0.2.1:5"}
	got, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := json.Marshal(map[string]any{
		"nodeId": d.NodeID, "siteId": d.SiteID, "role": d.Role, "certSerial": d.CertSerial, "previousSerial": d.PreviousSerial,
		"identityGeneration": d.IdentityGeneration, "notAfter": d.NotAfter, "peer": d.Peer,
	})
	if string(got) != string(want) {
		t.Errorf("renewedData encodes as\n%s\nthe map as\n%s", got, want)
	}
	for _, c := range []struct {
		in   string
		want int
	}{{"[]", 0}, {`["urn:bc:a","b"]`, 2}} {
		l, err := stringList([]byte(c.in))
		if err != nil || len(l) != c.want {
			t.Errorf("stringList(%s) = %q, %v", c.in, l, err)
		}
	}
	if _, err := stringList([]byte("{")); err == nil {
		t.Error("stringList accepted bad JSON")
	}
}
