//! Per-team bound on generation requests in flight (`--max-requests-per-team`): one team's burst
//! gets 429s instead of filling the model's waiting queue for every other team.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::ApiError;

/// Counts each team's generation requests from validation to the last byte of the response.
#[derive(Debug)]
pub struct TeamRequests {
    limit: Option<usize>,
    in_flight: Mutex<HashMap<String, usize>>,
}

/// One request's place in its team's count; dropping it (the response finished, or the client
/// went away) gives the place back.
#[derive(Debug)]
pub struct TeamRequestSlot {
    owner: Arc<TeamRequests>,
    team: String,
}

impl TeamRequests {
    /// `None`: no bound.
    pub fn new(limit: Option<usize>) -> Arc<TeamRequests> {
        Arc::new(TeamRequests {
            limit,
            in_flight: Mutex::new(HashMap::new()),
        })
    }

    /// Takes a place for one more request of `team`, or a 429 when the team has `limit` in
    /// flight.
    pub fn enter(self: &Arc<Self>, team: &str) -> Result<TeamRequestSlot, ApiError> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        let count = in_flight.entry(team.to_owned()).or_insert(0);
        if let Some(limit) = self.limit.filter(|&limit| *count >= limit) {
            return Err(ApiError::TooManyRequests(format!(
                "Team {team} already has {limit} requests in flight (--max-requests-per-team). \
                 Try again when one has finished."
            )));
        }
        *count += 1;
        Ok(TeamRequestSlot {
            owner: self.clone(),
            team: team.to_owned(),
        })
    }

    /// The team's requests in flight now.
    pub fn in_flight(&self, team: &str) -> usize {
        let in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        in_flight.get(team).copied().unwrap_or(0)
    }
}

impl Drop for TeamRequestSlot {
    fn drop(&mut self) {
        let mut in_flight = self
            .owner
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(count) = in_flight.get_mut(&self.team) {
            *count -= 1;
            if *count == 0 {
                in_flight.remove(&self.team);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_team_past_its_limit_gets_a_429_and_other_teams_do_not() {
        let requests = TeamRequests::new(Some(2));
        let a1 = requests.enter("a").unwrap();
        let _a2 = requests.enter("a").unwrap();
        let refused = requests.enter("a").unwrap_err();
        assert!(matches!(refused, ApiError::TooManyRequests(_)), "{refused}");
        let _b = requests.enter("b").unwrap();
        drop(a1);
        assert_eq!(requests.in_flight("a"), 1);
        let _a3 = requests.enter("a").unwrap();
    }

    #[test]
    fn no_limit_counts_but_never_refuses() {
        let requests = TeamRequests::new(None);
        let slots: Vec<_> = (0..1000).map(|_| requests.enter("a").unwrap()).collect();
        assert_eq!(requests.in_flight("a"), 1000);
        drop(slots);
        assert_eq!(requests.in_flight("a"), 0);
    }
}
