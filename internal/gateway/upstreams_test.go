package gateway

import (
	"strings"
	"testing"
)

// api_url or api_urls, each an https URL, none twice.
func TestConfigAPIURLs(t *testing.T) {
	base := Config{CertFile: "c", KeyFile: "k", APICAFile: "ca"}
	for _, c := range []struct {
		name    string
		url     string
		urls    []string
		wantErr string
	}{
		{"one", "https://a:1", nil, ""},
		{"several", "", []string{"https://a:1", "https://b:1"}, ""},
		{"none", "", nil, "api_url"},
		{"both", "https://a:1", []string{"https://b:1"}, "not both"},
		{"twice", "", []string{"https://a:1", "https://a:1/"}, "twice"},
		{"not https", "", []string{"https://a:1", "http://b:1"}, "api_urls"},
	} {
		cfg := base
		cfg.APIURL, cfg.APIURLs = c.url, c.urls
		err := cfg.validate()
		switch {
		case c.wantErr == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.wantErr != "" && (err == nil || !strings.Contains(err.Error(), c.wantErr)):
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.wantErr)
		}
	}
}
